"""Micro-batching and the stage split, in one process."""
import pytest
import torch

from autoplan.models.llama import build_llama
from hyper_parallel.core.pipeline_parallel import (
    BatchDimSpec, even_cuts, split_microbatches, split_model, stage_units, tied_parameters,
)
from hyper_parallel.errors import MicrobatchError, StageSplitError
from hyper_parallel.local import fake_world


def test_args_and_kwargs_split_by_spec():
    x = torch.arange(24).view(4, 6)
    mask = torch.ones(6, 4)
    table = torch.zeros(3)
    args, kwargs = split_microbatches([x, "tag"], {"mask": mask, "table": table}, 2,
                                      kwarg_specs={"mask": BatchDimSpec(1), "table": BatchDimSpec(-1)})
    assert [a[0].tolist() for a in args] == [x[:2].tolist(), x[2:].tolist()]
    assert all(a[1] == "tag" for a in args)
    assert kwargs[1]["mask"].shape == (6, 2) and kwargs[0]["table"] is table


def test_indivisible_and_bad_specs_name_the_argument():
    with pytest.raises(MicrobatchError, match="positional argument 0: batch dim 0 has size 5, which 2"):
        split_microbatches([torch.zeros(5, 3)], None, 2)
    with pytest.raises(MicrobatchError, match="keyword argument 'mask': batch dim 3 is out of range"):
        split_microbatches([], {"mask": torch.zeros(2, 2)}, 2, kwarg_specs={"mask": 3})
    with pytest.raises(MicrobatchError, match="not passed: \\['nope'\\]"):
        split_microbatches([], {}, 2, kwarg_specs={"nope": 0})
    with pytest.raises(MicrobatchError, match="positive int"):
        split_microbatches([], {}, 0)


def test_dtensor_inputs_keep_their_placement():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        rep = DTensor.from_local(torch.arange(8.0).view(4, 2), mesh, [Replicate()], run_check=False)
        seq = DTensor.from_local(torch.arange(8.0).view(4, 2), mesh, [Shard(1)], run_check=False)
        (a0, b0), (a1, b1) = [mb for mb in split_microbatches([rep, seq], None, 2)[0]]
        assert a0.placements == (Replicate(),) and a0.shape == (2, 2)
        assert b1.placements == (Shard(1),) and b1.shape == (2, 4)
        assert a1.to_local().tolist() == [[4.0, 5.0], [6.0, 7.0]]


def test_split_keeps_fqns_and_matches_the_whole_model():
    model = build_llama(0, n_layers=4, dim=32, vocab_size=64, ffn_hidden=64, tie_embeddings=True)
    cuts = even_cuts(model, 3)
    assert cuts == ["layers.2", "layers.3"]
    stages = split_model(model, cuts)
    names = {n for s in stages for n, _ in s.named_parameters(remove_duplicate=False)}
    assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    x = torch.randint(0, 64, (2, 8))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x), rtol=0, atol=0)
    assert tied_parameters(model, cuts) == [{0: "tok_embeddings.weight", 2: "output.weight"}]
    # more stages than blocks: embedding, norm and head get stages of their own
    assert len(stage_units(model, even_cuts(model, 7))) == 7


def test_bad_cuts_are_named():
    model = build_llama(0, n_layers=2, dim=32, vocab_size=64, ffn_hidden=64)
    with pytest.raises(StageSplitError, match="cut 'layers.9' is not a stage boundary"):
        split_model(model, ["layers.9"])
    with pytest.raises(StageSplitError, match="in model order"):
        split_model(model, ["layers.1", "layers.0"])
    with pytest.raises(StageSplitError, match="stage 5 does not exist"):
        split_model(model, ["layers.1"], [5])
    with pytest.raises(StageSplitError, match="Linear has no block list"):
        split_model(torch.nn.Linear(2, 2), [])


@pytest.mark.parametrize("arch", ["Llama", "Qwen2"])
def test_hf_causal_lm_split_rebuilds_rope_and_mask_on_every_stage(arch):
    import transformers

    cfg_cls = getattr(transformers, f"{arch}Config")
    model_cls = getattr(transformers, f"{arch}ForCausalLM")
    cfg = cfg_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    model = model_cls(cfg)
    x = torch.randint(0, 64, (2, 8))
    pad = torch.ones(2, 8, dtype=torch.long)
    pad[0, :3] = 0  # left padding on one row: the mask must reach every stage
    stages = split_model(model, even_cuts(model, 3))
    h = x
    for s in stages:
        h = s(h, attention_mask=pad)
    torch.testing.assert_close(h, model(x, attention_mask=pad).logits, rtol=1e-5, atol=1e-5)
