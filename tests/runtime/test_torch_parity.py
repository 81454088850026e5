"""Where hyper_parallel's parallelize_module follows torch's, side by side with torch (the
deliberate differences are listed in docs/runtime.md, "Differences from torch's styles"):

- a plan key matching no module is skipped with a warning (``strict=True``: an error);
- no plan: a warning and nothing changes (``strict=True``: an error);
- no ``device_mesh``: the mesh of the enclosing ``with mesh:`` context;
- a plan that is neither a style nor a dict: a TypeError;
- a PrepareModuleInput with more layouts than inputs: a ValueError (ours before anything is
  applied, torch's at the first forward).
"""
import warnings

import pytest
import torch
import torch.distributed.tensor.parallel as tp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from hyper_parallel import ColwiseParallel, PrepareModuleInput, Replicate, RowwiseParallel, parallelize_module
from hyper_parallel.errors import MeshError, PlanPatternError, PlanTypeError
from hyper_parallel.local import fake_world


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
