"""Where hyper_parallel's parallelize_module follows torch's, side by side with torch (the
deliberate differences are listed in docs/runtime.md, "Differences from torch's styles"):

- a plan key matching no module is skipped with a warning (``strict=True``: an error);
- no plan: a warning and nothing changes (``strict=True``: an error);
- no ``device_mesh``: the mesh of the enclosing ``with mesh:`` context;
- a plan that is neither a style nor a dict: a TypeError;
- a PrepareModuleInput with more layouts than inputs: a ValueError (ours before anything is
  applied, torch's at the first forward);
- PrepareModuleInput / PrepareModuleInputOutput with positional layouts plus keyword layouts, and
  SequenceParallel (by default no collective in backward, gradients left Partial), on 2 gloo ranks:
  the same outputs, gradients and collectives as torch's.
"""
import warnings

import pytest
import torch
import torch.distributed.tensor.parallel as tp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from autoplan.parallelisms.tensor import runner_styles
from hyper_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from hyper_parallel.errors import MeshError, PlanPatternError, PlanTypeError
from hyper_parallel.local import fake_world
from tests.runtime import parity_workers


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


@pytest.fixture(scope="module")
def mesh():
    with fake_world(2):
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _sharded(model) -> list[str]:
    """Weights that became DTensors (a row-wise bias is a replicated DTensor in ours, not in torch's)."""
    return [n for n, p in model.named_parameters() if type(p).__name__ == "DTensor" and n.endswith("weight")]


def test_unmatched_key_warns_and_the_rest_applies_like_torch(mesh):
    ours, theirs = mlp(), mlp()
    with pytest.warns(UserWarning, match=r"'9' matches no module.*skipping"):
        parallelize_module(ours, mesh, {"0": ColwiseParallel(), "9": RowwiseParallel()})
    with pytest.warns(UserWarning, match="could not be resolved"):
        tp.parallelize_module(theirs, mesh, {"0": tp.ColwiseParallel(), "9": tp.RowwiseParallel()})
    assert _sharded(ours) == _sharded(theirs) == ["0.weight"]


def test_strict_makes_an_unmatched_key_an_error_and_changes_nothing(mesh):
    model = mlp()
    with pytest.raises(PlanPatternError, match="'9' matches no module"):
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "9": RowwiseParallel()}, strict=True)
    assert _sharded(model) == []


def test_no_plan_warns_like_torch_or_errors_when_strict(mesh):
    model = mlp()
    with pytest.warns(UserWarning, match="no plan given"):
        assert parallelize_module(model, mesh) is model
    with pytest.warns(UserWarning, match="No parallelize_plan"):
        tp.parallelize_module(mlp(), mesh)
    with pytest.raises(PlanPatternError, match="no plan given"):
        parallelize_module(model, mesh, strict=True)


def test_mesh_comes_from_the_context_like_torch(mesh):
    ours, theirs = mlp(), mlp()
    with mesh:
        parallelize_module(ours, parallelize_plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
        tp.parallelize_module(theirs, parallelize_plan={"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})
    assert _sharded(ours) == _sharded(theirs) == ["0.weight", "2.weight"]
    with pytest.raises(MeshError, match="no DeviceMesh context"):
        parallelize_module(mlp(), parallelize_plan={"0": ColwiseParallel()})


def test_a_plan_of_the_wrong_type_is_a_type_error_like_torch(mesh):
    with pytest.raises(PlanTypeError, match="expected a ParallelStyle or a dict") as ours:
        parallelize_module(mlp(), mesh, 3)
    assert isinstance(ours.value, TypeError)
    with pytest.raises(TypeError):
        tp.parallelize_module(mlp(), mesh, 3)


def test_too_many_input_layouts_is_a_value_error_in_both(mesh):
    style = dict(input_layouts=(Replicate(), Replicate()), desired_input_layouts=(Replicate(), Replicate()))
    with pytest.raises(ValueError, match="input_layouts has 2 entries"):
        parallelize_module(nn.Linear(8, 8), mesh, PrepareModuleInput(**style))
    theirs = tp.parallelize_module(nn.Linear(8, 8), mesh, tp.PrepareModuleInput(**style))
    with warnings.catch_warnings(), pytest.raises(ValueError):
        warnings.simplefilter("ignore")
        theirs(torch.randn(2, 8))


# ---- on 2 gloo ranks: same outputs, gradients (and their placements) and collectives as torch's ----

def _same(ours: dict, theirs: dict, where: str) -> None:
    assert torch.allclose(ours["out"], theirs["out"], rtol=1e-6, atol=1e-7), f"{where}: outputs differ"
    assert set(ours["grads"]) == set(theirs["grads"]), where
    for n, g in theirs["grads"].items():
        assert torch.allclose(ours["grads"][n], g, rtol=1e-6, atol=1e-7), f"{where}: gradient of {n} differs"
    assert ours["grad_placements"] == theirs["grad_placements"], where
    assert ours["per_module"] == theirs["per_module"], f"{where}: collectives {ours['per_module']} vs torch " \
                                                        f"{theirs['per_module']}"


@pytest.mark.parametrize("both", [False, True], ids=["PrepareModuleInput", "PrepareModuleInputOutput"])
@pytest.mark.parametrize("kind", ["kwonly", "kw_or_pos"])
def test_positional_and_keyword_layouts_behave_as_torch(pool2, kind, both):
    """input_layouts for x (positional) and input_kwarg_layouts for y (keyword), as torch's test."""
    for rank, r in enumerate(pool2.run(parity_workers.prepare_input_positional_and_keyword, kind, both)):
        where = f"rank {rank} {kind}"
        _same(r["ours"], r["torch"], where)
        for a, b in zip(r["ours"]["input_grads"], r["torch"]["input_grads"]):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"{where}: input gradients differ"
        assert r["ours"]["totals"].get("all_gather", 0) >= 2, r["ours"]["totals"]  # x and y were gathered


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_sequence_parallel_defaults_to_torchs_backward(pool2, norm):
    """No collective in backward, weight gradients left Partial -- exactly torch's SequenceParallel."""
    for rank, r in enumerate(pool2.run(parity_workers.sequence_parallel, norm, None)):
        _same(r["ours"], r["torch"], f"rank {rank} {norm}")
        assert r["ours"]["totals"] == {}, r["ours"]["totals"]
        assert set(r["ours"]["grad_placements"].values()) == {("P(sum)",)}


def test_sequence_parallel_reduce_grads_is_the_one_extra_all_reduce(pool2):
    """``reduce_grads=True`` (what autoplan's runners apply): the same numbers, the weight gradient
    replicated when backward ends, one all-reduce per weight more than torch's."""
    for r in pool2.run(parity_workers.sequence_parallel, "rmsnorm", True):
        ours, theirs = r["ours"], r["torch"]
        assert torch.allclose(ours["out"], theirs["out"]) and torch.allclose(ours["grads"]["weight"],
                                                                              theirs["grads"]["weight"])
        assert theirs["totals"] == {} and ours["totals"] == {"all_reduce": 1}
        assert ours["grad_placements"] == {"weight": ("R",)}


def test_autoplan_runners_choose_the_gradient_reduction():
    """A plan file's SequenceParallel (torch's default or not) is applied with reduce_grads=True."""
    styles = runner_styles({"norm": {"style": "SequenceParallel", "args": {"sequence_dim": 2}},
                            "wq": {"style": "ColwiseParallel", "args": {}}})
    assert styles["norm"] == SequenceParallel(sequence_dim=2, reduce_grads=True)
    assert styles["wq"] == ColwiseParallel()
