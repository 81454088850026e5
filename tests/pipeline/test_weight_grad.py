"""dx/dw split on one stage: I then W gives B's gradients exactly, and W does no dx work."""
import copy

import pytest
import torch
import torch.nn.functional as F

from autoplan.models.llama import build_llama
from hyper_parallel.core.pipeline_parallel import PipelineStage, split_model


def _run(stages, x, y, split: bool):
    stage = PipelineStage(stages[1], 1, 2, device="cpu")
    out = stage.forward(0, [stages[0](x).detach()], {})
    stage.set_loss(0, F.cross_entropy(out[0].flatten(0, 1), y.flatten()))
    if split:
        stage.backward(0, None, "input")
        assert all(p.grad is None for p in stages[1].parameters()), "I must not touch weights"
        leaf = stage._inputs[0][0]
        stage.backward(0, None, "weight")
        assert leaf.grad is None, "W recomputed the input gradient"
    else:
        stage.backward(0, None, "full")
    return {n: p.grad for n, p in stages[1].named_parameters()}, stage.input_grads[0][0]


@pytest.mark.parametrize("tie", [False, True])
def test_split_backward_equals_full_backward(tie):
    model = build_llama(0, n_layers=4, dim=32, vocab_size=64, ffn_hidden=64, tie_embeddings=tie)
    twin = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    grads, dx = _run(split_model(model, ["layers.2"]), x, y, split=True)
    ref, ref_dx = _run(split_model(twin, ["layers.2"]), x, y, split=False)
    assert grads.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(dx, ref_dx, rtol=0, atol=0)


def test_grouping_tells_parameters_apart_by_identity():
    """Merging tap groups once removed a group with ``list.remove``, which compares groups with
    ``==`` and so their parameters element-wise: two groups of one multi-valued tensor each, the
    second hit by a later parameter, raised "Boolean value of Tensor ... ambiguous" (Nemotron at
    pp=2 x tp=2; a DTensor beside a tensor raised "mixed torch.Tensor and DTensor")."""
    from hyper_parallel.core.pipeline_parallel.weight_grad import _group

    params = [torch.randn(3), torch.randn(3), torch.randn(3), torch.randn(3)]
    nodes = ["n0", "n1", "n2", "n3"]
    taps_of = {"n0": {"a"}, "n1": {"b"}, "n2": {"b", "c"}, "n3": {"c"}}
    groups = _group(params, nodes, taps_of)
    assert [sorted(ns) for _, ns, _ in groups] == [["n0"], ["n1", "n2", "n3"]]
    merged = groups[1][0]
    assert len(merged) == 3 and all(any(p is q for q in merged) for p in params[1:])


def test_split_backward_equals_full_backward_nemotron():
    """A transformers Nemotron (LayerNorm1P, squared-ReLU MLP) cut in two: I then W equals B."""
    from autoplan.verify.shrink import ModelRecipe

    cfg = dict(model_type="nemotron", model_class="NemotronForCausalLM", hidden_size=32, intermediate_size=64,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=4, vocab_size=64)
    model = ModelRecipe(hf_config=cfg, seed=1).build()
    twin = copy.deepcopy(model)
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    grads, dx = _run(split_model(model, ["model.layers.2"]), x, y, split=True)
    ref, ref_dx = _run(split_model(twin, ["model.layers.2"]), x, y, split=False)
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(dx, ref_dx, rtol=0, atol=0)
