"""autoplan(model, mesh, ...) and autoplan(model, N, ...) / plan_cluster: every argument of the
issue-19 catalogue is refused with a typed error naming it (model untouched), or, where the input
is legitimate, gives the right plan."""
from __future__ import annotations

import pytest
import torch

from autoplan import MeshSpec, autoplan, plan_cluster
from autoplan.context_search import plan_context
from autoplan.hsdp import plan_hsdp
from autoplan.errors import (
    AutoplanError, InvalidArgumentError, MeshNameError, MissingInputsError, PlanningError,
)
from tests.inputs.helpers import SmallCNN, snapshot, tiny_llama

H100 = "h100_sxm"


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _refused(model, exc, match, *args, **kwargs):
    before = snapshot(model)
    with pytest.raises(exc, match=match):
        autoplan(model, *args, **kwargs)
    assert snapshot(model) == before


# ---------------------------------------------------------------- mesh names (issue item 1)
@pytest.mark.parametrize("name", ["dp", "fsdp", "data", "dp_shard"])
def test_1d_data_parallel_mesh_is_not_also_tensor_parallel(model, name):
    plan = autoplan(model, MeshSpec((2,), (name,), H100), batch=(4, 16))
    assert plan.tp_dim is None and plan.dp_dim == name
    assert plan.styles == {}
    assert plan.fsdp == {"enabled": True, "dim": name}
    assert {c["mesh_dim"] for c in plan.predictions["collectives"]} == {name}


@pytest.mark.parametrize("name", ["tp", "model", "tensor"])
def test_1d_tensor_parallel_aliases(model, name):
    plan = autoplan(model, MeshSpec((2,), (name,), H100), batch=(2, 16))
    assert plan.tp_dim == name and plan.dp_dim is None


@pytest.mark.parametrize("names", [("x", "y"), ("dim0", "dim1"), ("dp", "y")])
def test_unnamed_mesh_dimensions_are_an_error(model, names):
    with pytest.raises(MeshNameError, match="does not say which parallelism"):
        MeshSpec((2, 2), names, H100)
    _refused(model, MeshNameError, "does not say", {"shape": [2, 2], "names": list(names)}, batch=(4, 16))


def test_two_dimensions_for_one_parallelism(model):
    with pytest.raises(MeshNameError, match="both mean 'dp'"):
        MeshSpec((2, 2), ("fsdp", "dp_shard"), H100)
    MeshSpec((2, 2), ("dp_replicate", "dp_shard"), H100)  # HSDP: the replicated and the sharded half
    with pytest.raises(MeshNameError, match="both mean 'tp'"):
        MeshSpec((2, 2), ("tp", "model"), H100)


def test_unnamed_device_mesh(model):
    from hyper_parallel.local import fake_world
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2))
        _refused(model, MeshNameError, "no mesh_dim_names", mesh, batch=(4, 16))


def test_pipeline_mesh_needs_the_cluster_planner(model):
    _refused(model, InvalidArgumentError, "device count", MeshSpec((2, 2), ("pp", "tp"), H100), batch=(4, 16))


# ---------------------------------------------------------------- keywords (issue item 4)
def test_unknown_keyword_is_a_type_error(model):
    with pytest.raises(TypeError, match="memory_limt"):
        autoplan(model, MeshSpec((2,), ("tp",), H100), batch=(2, 16), memory_limt=1)
    with pytest.raises(TypeError, match="memory_limt"):
        plan_cluster(model, 4, batch=(8, 16), memory_limt=1)
    with pytest.raises(TypeError, match="memory_limt"):
        autoplan(model, 4, batch=(8, 16), memory_limt=1)
    with pytest.raises(TypeError, match="constraints"):  # a cluster option on a mesh
        autoplan(model, MeshSpec((2,), ("tp",), H100), batch=(2, 16), constraints={"pp": 1})


def test_int_path_refuses_styles_inputs_graph(model):
    from autoplan.models.llama_plans import EXPERT_PLANS

    styles = {k: v.to_dict() for k, v in EXPERT_PLANS["torchtitan"]().items()}
    _refused(model, InvalidArgumentError, "styles= is not supported with a device count", 4, batch=(8, 16),
             styles=styles)
    _refused(model, InvalidArgumentError, "inputs= is not supported", 4, inputs=(torch.zeros(2, 8, dtype=torch.long),),
             batch=(8, 16))


def test_int_path_honours_fsdp_and_checkpointing(model):
    plan = autoplan(model, 4, batch=(8, 16), fsdp=False, activation_checkpointing=True,
                    constraints={"dp": 4}, microbatch_sizes=(2,))
    assert plan.fsdp["enabled"] is False and plan.activation_checkpointing is True
    assert all(a["fsdp"] is False and a["activation_checkpointing"] is True for a in plan.alternatives)
    with pytest.raises(InvalidArgumentError, match="contradicts"):
        autoplan(model, 4, batch=(8, 16), fsdp=False, constraints={"fsdp": True})


# ---------------------------------------------------------------- values
@pytest.mark.parametrize("limit, exc, match", [
    ("80GB", InvalidArgumentError, "memory_limit='80GB' must be bytes"),
    (-1, InvalidArgumentError, "positive"), (0, InvalidArgumentError, "positive"),
    (float("nan"), InvalidArgumentError, "positive"), (True, InvalidArgumentError, "memory_limit=True"),
])
def test_bad_memory_limit(model, limit, exc, match):
    _refused(model, exc, match, MeshSpec((2,), ("tp",), H100), batch=(2, 16), memory_limit=limit)
    with pytest.raises(exc, match=match):
        plan_cluster(model, 4, batch=(8, 16), memory_limit=limit)


def test_infinite_memory_limit_means_no_limit(model):
    plan = autoplan(model, MeshSpec((2,), ("tp",), H100), batch=(2, 16), memory_limit=float("inf"))
    assert plan.predictions["memory_bytes"]["total"] > 0


@pytest.mark.parametrize("batch, match", [
    ((0, 16), r"batch\[0\].*>= 1"), ((-4, 16), r"batch\[0\]"), ((4, 0), r"batch\[1\] \(seq_len\)=0"),
    ((4, -1), r"seq_len"), ((4.5, 16), "positive integer"), ((True, 16), "positive integer"),
    ("4x16", "must be"), ((4,), "must be"), ((4, 16, 1), "must be"),
])
def test_bad_batch(model, batch, match):
    _refused(model, InvalidArgumentError, match, MeshSpec((2,), ("tp",), H100), batch=batch)
    with pytest.raises(InvalidArgumentError, match=match):
        plan_cluster(model, 4, batch=batch)


def test_batch_not_divisible_by_dp(model):
    _refused(model, PlanningError, "not divisible by dp=4", MeshSpec((4,), ("dp",), H100), batch=(6, 16))


def test_seq_longer_than_positions(model):
    _refused(model, InvalidArgumentError, "seq_len=128 is longer than the 64 positions", MeshSpec((2,), ("tp",), H100),
             batch=(2, 128))
    with pytest.raises(InvalidArgumentError, match="64 positions"):
        plan_cluster(model, 4, batch=(8, 128))


@pytest.mark.parametrize("dtype", ["int8", torch.int64, torch.bool, 5, "float8"])
def test_bad_dtype(model, dtype):
    _refused(model, InvalidArgumentError, "dtype=", MeshSpec((2,), ("tp",), H100), batch=(2, 16), dtype=dtype)


def test_dtype_by_name_is_read(model):
    plan = autoplan(model, MeshSpec((2,), ("tp",), H100), batch=(2, 16), dtype="bf16")
    assert plan.batch["dtype"] == "torch.bfloat16"
    plan = autoplan(model, MeshSpec((2,), ("tp",), H100), batch=(2, 16), dtype="float32")
    assert plan.batch["dtype"] == "torch.float32"


def test_cnn_from_batch_says_to_pass_inputs():
    cnn = SmallCNN().to("meta")
    before = snapshot(cnn)
    with pytest.raises(MissingInputsError, match="pass example inputs="):
        autoplan(cnn, MeshSpec((2,), ("tp",), H100), batch=(4, 16))
    assert snapshot(cnn) == before
    plan = autoplan(cnn, MeshSpec((2,), ("tp",), H100), inputs=(torch.empty(2, 3, 16, 16),))
    assert plan.predictions["step_s"] > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(hardware="h900"), "not a known profile"), (dict(hardware=3), "profile name"),
    (dict(fsdp="no"), "fsdp='no'"), (dict(sequence_parallel=1), "sequence_parallel=1"),
    (dict(activation_checkpointing="yes"), "activation_checkpointing"),
    (dict(allow_replicated_units=None), "allow_replicated_units"), (dict(styles=[]), "styles="),
])
def test_bad_option_values(model, kwargs, match):
    _refused(model, InvalidArgumentError, match, MeshSpec((2,), ("tp",), H100), batch=(2, 16), **kwargs)


def test_not_a_model_or_mesh(model):
    with pytest.raises(InvalidArgumentError, match="torch.nn.Module"):
        autoplan("llama", MeshSpec((2,), ("tp",), H100), batch=(2, 16))
    _refused(model, InvalidArgumentError, "mesh must be", [2, 2], batch=(2, 16))
    _refused(model, InvalidArgumentError, "needs 'shape' and 'names'", {"shape": [2]}, batch=(2, 16))
    _refused(model, AutoplanError, "positive integers", {"shape": [0], "names": ["tp"]}, batch=(2, 16))
    with pytest.raises(InvalidArgumentError, match="devices=0"):
        autoplan(model, 0, batch=(8, 16))


# ---------------------------------------------------------------- plan_cluster constraints
@pytest.mark.parametrize("constraints, match", [
    ({"microbatches": 0}, r"microbatches'\]=0 must be >= 1"),
    ({"microbatches": 3}, "does not divide the global batch 8"),
    ({"microbatch_size": 3}, "does not divide the global batch 8"),
    ({"schedule": "Zigzag"}, "'Zigzag' is not a schedule"),
    ({"pp": 3}, "does not divide devices=4"),
    ({"pp": 4, "tp": 2}, "cannot make devices=4"),
    ({"dp": 2, "pp": 1, "tp": 1}, "cannot make devices=4"),
    ({"pipeline": 2}, "unknown constraints"),
    ({"fsdp": "yes"}, "fsdp"),
    ("pp=2", "must be a dict"),
])
def test_bad_constraints(model, constraints, match):
    before = snapshot(model)
    with pytest.raises(InvalidArgumentError, match=match):
        plan_cluster(model, 4, batch=(8, 16), constraints=constraints)
    assert snapshot(model) == before


def test_pp_larger_than_the_model(model):
    with pytest.raises(InvalidArgumentError, match=r"constraints\['pp'\]=8 exceeds the model's 5 pipeline units"):
        plan_cluster(model, 8, batch=(8, 16), constraints={"pp": 8})


@pytest.mark.parametrize("kwargs, match", [
    (dict(schedules=["1F1B", "Zigzag"]), "not known"), (dict(schedules="1F1B"), "non-empty list"),
    (dict(microbatch_sizes=(0,)), "microbatch_sizes"), (dict(virtual_stages=()), "non-empty list"),
    (dict(devices_per_node=0), "devices_per_node"), (dict(alternatives=0), "alternatives"),
    (dict(time_budget_s=-1), "time_budget_s"), (dict(time_budget_s=float("nan")), "time_budget_s"),
])
def test_bad_cluster_options(model, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        plan_cluster(model, 4, batch=(8, 16), **kwargs)


@pytest.mark.parametrize("entry", ["plan_cluster", "plan_hsdp", "plan_context"])
def test_devices_per_node_must_fit_the_devices(model, entry):
    """3 devices per node for 8 devices describes no cluster (the last node would hold 2): refused by
    every entry that takes it, naming the argument and the valid values, before any capture."""
    call = {"plan_cluster": lambda: plan_cluster(model, 8, batch=(8, 16), devices_per_node=3),
            "plan_hsdp": lambda: plan_hsdp(model, 8, tp=2, batch=(8, 16), devices_per_node=3),
            "plan_context": lambda: plan_context(model, 8, batch=(8, 16), devices_per_node=3)}[entry]
    before = snapshot(model)
    with pytest.raises(InvalidArgumentError, match=r"devices_per_node=3 does not divide devices=8.*valid"):
        call()
    assert snapshot(model) == before


def test_devices_per_node_may_exceed_the_devices(model):
    """Fewer devices than one node holds is one partly used node, not an error."""
    plan = plan_cluster(model, 4, batch=(8, 16), devices_per_node=8, constraints={"pp": 1, "tp": 2})
    assert plan.mesh["devices_per_node"] == 8
