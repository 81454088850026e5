"""parallelize_module on a model that is already parallelized -- by us or by torch -- is refused
before anything changes; legitimate second calls on other modules still work;
a Shard dimension the input lacks is a LayoutError naming the style's module at forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor import parallel as tp

from autoplan.models.llama_plans import torchtitan_plan
from hyper_parallel import ColwiseParallel, PrepareModuleInput, Replicate, RowwiseParallel, parallelize_module
from hyper_parallel.core.tensor_parallel.base import to_dtensor
from hyper_parallel.errors import AlreadyParallelizedError, LayoutError
from hyper_parallel.local import fake_world
from tests.inputs.helpers import snapshot, tiny_llama


@pytest.fixture(scope="module")
def mesh():
    with fake_world(2):
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _refused(model, mesh, plan, match):
    before = snapshot(model)
    with pytest.raises(AlreadyParallelizedError, match=match):
        parallelize_module(model, mesh, plan)
    assert snapshot(model) == before


def test_same_plan_twice(mesh):
    model = tiny_llama(device="cpu")
    parallelize_module(model, mesh, torchtitan_plan())
    _refused(model, mesh, torchtitan_plan(), "already parallelized: an earlier parallelize_module call applied")


def test_colwise_then_rowwise_on_one_linear(mesh):
    model = _mlp()
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    _refused(model, mesh, {"0": RowwiseParallel()}, r"module '0' \(Linear\) is already parallelized")


def test_torch_styles_then_ours(mesh):
    model = _mlp()
    tp.parallelize_module(model, mesh, {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})
    _refused(model, mesh, {"0": ColwiseParallel()}, "already a DTensor")
    _refused(model, mesh, {"2": RowwiseParallel()}, "already a DTensor")


def test_torch_prepare_input_then_ours(mesh):
    model = _mlp()
    tp.parallelize_module(model, mesh, {"": tp.PrepareModuleInput(input_layouts=(Replicate(),),
                                                                  desired_input_layouts=(Replicate(),))})
    _refused(model, mesh, {"": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))},
             "hook from torch's tensor parallelism")


def test_second_call_on_other_modules_is_fine(mesh):
    """torchtitan's own pattern: the blocks in one call, embedding/head in another."""
    model = _mlp()
    parallelize_module(model, mesh, {"0": ColwiseParallel()})
    parallelize_module(model, mesh, {"2": RowwiseParallel()})
    assert getattr(model[2], "_hp_parallelized").startswith("RowwiseParallel")


def test_failed_apply_leaves_no_mark(mesh):
    """A refused or rolled-back call does not mark the model: a corrected call then works."""
    model = _mlp()
    before = snapshot(model)
    with pytest.raises(Exception):
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "nope": RowwiseParallel()}, strict=True)
    assert snapshot(model) == before
    parallelize_module(model, mesh, {"0": ColwiseParallel()})


def test_shard_dim_the_input_lacks(mesh):
    x = torch.zeros(2, 4)
    with pytest.raises(LayoutError, match=r"layers.0: desired layout Shard\(5\) names a dimension the 2-D input"):
        to_dtensor(x, mesh, Replicate(), Shard(5), "layers.0")
    with pytest.raises(LayoutError, match=r"layout Shard\(-3\)"):
        to_dtensor(x, mesh, Shard(-3), None, "layers.0")
