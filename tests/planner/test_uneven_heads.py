"""Heads the tp degree does not divide (GPT-2 XL: 25 heads at tp=4) split whole and unevenly, 6, 6,
6 and 7 heads (hyper_parallel's HeadRowsParallel / HeadColsParallel with PrepareHeadsInput's
``head_count``): planned at GPT-2 XL's width with replicated units forbidden, on the replicated and
on the sequence-sharded stream, one SGD step on a small copy on 4 gloo ranks equals one device
(loss rtol 1e-5, every gradient rtol 1e-4 / atol 1e-6), and the collectives the plan predicts --
the projections' gradient all-reduces among them -- are the ones a dry run issues."""
import pytest
import torch
import transformers
from torch.distributed.device_mesh import init_device_mesh

from autoplan import MeshSpec, autoplan
from autoplan.verify.dry_run import verify
from autoplan.verify.numerics import check_numerics
from autoplan.verify.shrink import recipe_for
from hyper_parallel import HeadColsParallel, HeadRowsParallel, PrepareHeadsInput, style_from_dict
from hyper_parallel.core.tensor_parallel.uneven_heads import head_bounds
from hyper_parallel.errors import DivisibilityError, LayoutError, StyleSpecError
from hyper_parallel.local import fake_world


def _gpt2_xl_width():
    cfg = transformers.GPT2Config(n_layer=2, n_embd=1600, n_head=25, n_positions=512, vocab_size=8192,
                                  bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(cfg)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["R", "S"])
def test_gpt2_xl_heads_split_unevenly_equal_one_device(sequence_parallel, pool4):
    model = _gpt2_xl_width()
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(4, 512), allow_replicated_units=False,
                    sequence_parallel=sequence_parallel)
    picked = {d["unit"].split("/")[-1]: d["strategy"] for d in plan.decisions}
    assert picked["attention"] == "heads_uneven", picked
    assert plan.styles["transformer.h.*.attn.c_attn"] == {"style": "HeadRowsParallel",
                                                          "args": {"sections": [25, 25, 25]}}
    assert plan.styles["transformer.h.*.attn"]["args"]["head_count"] == 25
    result = check_numerics(plan, recipe_for(model, [4], seed=3), pool=pool4)
    assert result.passed, result.summary()
    dry = verify(plan, model)
    assert dry.passed, dry.mismatches()
    grads = dry.collectives[(dry.collectives["kind"] == "all_reduce") & (dry.collectives["phase"] == "backward")]
    assert (grads["issued"] > 0).any()


def test_head_bounds_are_whole_and_cover_every_head():
    assert [head_bounds(25, 4, r) for r in range(4)] == [(0, 6), (6, 12), (12, 18), (18, 25)]
    for heads, size in ((5, 4), (7, 3), (16, 4)):
        spans = [head_bounds(heads, size, r) for r in range(size)]
        assert spans[0][0] == 0 and spans[-1][1] == heads and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_uneven_head_styles_check_their_arguments():
    for bad in (None, [], [25, 0], "25", [25.0]):
        with pytest.raises(StyleSpecError):
            HeadRowsParallel(sections=bad)
    for bad in (None, 0, "25"):
        with pytest.raises(StyleSpecError):
            HeadColsParallel(heads=bad)
    with pytest.raises(StyleSpecError):
        PrepareHeadsInput(local_attributes=["num_heads"], head_count=25, attribute_divisors={"num_heads": 2})
    assert style_from_dict(HeadRowsParallel(sections=[5, 5, 5]).to_dict()) == HeadRowsParallel(sections=[5, 5, 5])
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with pytest.raises(DivisibilityError, match="equal head widths"):
            HeadRowsParallel(sections=[5, 5, 5]).check_module(torch.nn.Linear(8, 31), mesh, "attn.c_attn")
        with pytest.raises(DivisibilityError, match="fewer than the mesh size"):
            HeadColsParallel(heads=3).check_module(torch.nn.Linear(24, 8), mesh, "attn.c_proj")
        with pytest.raises(LayoutError, match="not a multiple of head_count"):
            attn = torch.nn.Module()
            attn.num_heads = 7
            PrepareHeadsInput(local_attributes=["num_heads"], head_count=5).check_module(attn, mesh, "attn")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["R", "S"])
def test_separate_q_k_v_heads_split_unevenly_equal_one_device(sequence_parallel, pool4):
    """HF Llama with 6 heads at tp=4 (1, 1, 2, 2 heads a rank): q, k and v each computing the rank's
    heads, the input gradient reduced once where the module's input is made replicated."""
    cfg = transformers.LlamaConfig(hidden_size=768, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6,
                                   intermediate_size=2048, vocab_size=4096, max_position_embeddings=512)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(4, 256), allow_replicated_units=False,
                    sequence_parallel=sequence_parallel)
    assert {d["unit"]: d["strategy"] for d in plan.decisions}["model.layers/attention"] == "heads_uneven"
    assert plan.styles["model.layers.*.self_attn.k_proj"] == {"style": "HeadRowsParallel", "args": {"sections": [6]}}
    result = check_numerics(plan, recipe_for(model, [4], seed=3), pool=pool4)
    assert result.passed, result.summary()
    dry = verify(plan, model)
    assert dry.passed, dry.mismatches()
