"""Multi-query attention (GPT-BigCode / StarCoder-1: one KV head) at tp=4: query heads sharded, the
fused [q|k|v]'s K/V columns kept whole on every rank with their gradients all-reduced over tp
(KVReplicatedParallel). Planned at a mid-size shape, one SGD step on a small copy on 4 gloo ranks
equals one device (loss rtol 1e-5, every gradient rtol 1e-4 / atol 1e-6), and the collectives the
plan predicts are the ones a dry run issues. Grouped-query attention with fewer KV heads than ranks
(Starcoder2's 2 at tp=4) takes the same form, each rank computing the one KV head its query heads read."""
import pytest
import torch
import transformers

from autoplan import MeshSpec, autoplan
from autoplan.verify.dry_run import verify
from autoplan.verify.numerics import check_numerics
from autoplan.verify.shrink import recipe_for
from hyper_parallel import KVReplicatedParallel, Replicate
from hyper_parallel.errors import DivisibilityError, StyleSpecError
from hyper_parallel.local import fake_world
from torch.distributed.device_mesh import init_device_mesh


def _bigcode():
    cfg = transformers.GPTBigCodeConfig(n_layer=2, n_embd=1024, n_head=16, n_inner=4096, n_positions=512,
                                        vocab_size=8192, multi_query=True)
    with torch.device("meta"):
        return transformers.GPTBigCodeForCausalLM(cfg)


@pytest.fixture(scope="module")
def planned():
    model = _bigcode()
    return model, autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(4, 512), allow_replicated_units=False,
                           sequence_parallel=False)


def test_gpt_bigcode_tp4_kv_replicated_equals_one_device(planned, pool4):
    model, plan = planned
    picked = {d["unit"].split("/")[-1]: d["strategy"] for d in plan.decisions}
    assert picked["attention"] == "kv_replicated", picked
    assert plan.styles["transformer.h.*.attn.c_attn"] == {"style": "KVReplicatedParallel",
                                                          "args": {"fused_heads": [16, 2]}}
    result = check_numerics(plan, recipe_for(model, [4], seed=3), pool=pool4)
    assert result.passed, result.summary()
    dry = verify(plan, model)
    assert dry.passed, dry.mismatches()


def test_gqa_with_fewer_kv_heads_than_ranks_is_kv_replicated_and_equals_one_device(pool4):
    cfg = transformers.Starcoder2Config(num_hidden_layers=2, hidden_size=1024, num_attention_heads=16,
                                        num_key_value_heads=2, intermediate_size=4096, vocab_size=8192,
                                        max_position_embeddings=512)
    with torch.device("meta"):
        model = transformers.Starcoder2ForCausalLM(cfg)
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(4, 512), allow_replicated_units=False,
                    sequence_parallel=True)
    picked = {d["unit"].split("/")[-1]: d["strategy"] for d in plan.decisions}
    assert picked["attention"] == "kv_replicated", picked
    assert plan.styles["model.layers.*.self_attn.k_proj"]["args"]["kv_heads"] == 2
    prep = plan.styles["model.layers.*.self_attn"]["args"]
    assert prep["attribute_divisors"] == {"num_key_value_groups": 2, "config.num_key_value_heads": 2}, prep
    result = check_numerics(plan, recipe_for(model, [4], seed=3), pool=pool4)
    assert result.passed, result.summary()


def test_kv_replicated_style_checks_its_arguments():
    for bad in ([16], [16, -1], "16,2", [0, 0]):
        with pytest.raises(StyleSpecError):
            KVReplicatedParallel(fused_heads=bad)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with pytest.raises(DivisibilityError, match="query heads"):
            KVReplicatedParallel(fused_heads=[6, 2]).check_module(torch.nn.Linear(8, 64), mesh, "attn.c_attn")
        with pytest.raises(DivisibilityError, match="head widths"):
            KVReplicatedParallel(fused_heads=[8, 2]).check_module(torch.nn.Linear(8, 63), mesh, "attn.c_attn")
        with pytest.raises(DivisibilityError, match="neither a multiple nor a divisor"):
            KVReplicatedParallel(kv_heads=3).check_module(torch.nn.Linear(8, 24), mesh, "attn.k_proj")
    with pytest.raises(StyleSpecError):
        KVReplicatedParallel(fused_heads=[16, 3], kv_heads=2)
    assert KVReplicatedParallel(fused_heads=[16, 2], input_layouts=Replicate()).to_dict()["args"] == {
        "fused_heads": [16, 2], "input_layouts": "Replicate()"}
