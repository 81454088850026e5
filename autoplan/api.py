"""autoplan(model, mesh) -> Plan: capture, cost, solve, and explain.

The mesh fixes the degrees (its ``tp`` dimension is the tensor-parallel group, ``dp`` the
data-parallel one); it may be a live DeviceMesh or an offline ParallelDims, so planning for 512
GPUs needs no process group. With a device count instead, ``autoplan`` is
:func:`autoplan.cluster.plan_cluster`; both end in :func:`autoplan.mesh_plan.plan_mesh`.
"""
from __future__ import annotations

import logging
import numbers
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoplan import arguments as A
from autoplan.cluster import CLUSTER_ONLY, plan_cluster
from autoplan.errors import InvalidArgumentError
from autoplan.mesh_plan import plan_mesh
from autoplan.plan.plan import Plan
from autoplan.request import PlanRequest
from hyper_parallel.errors import MeshError, MeshNameError
from hyper_parallel.parallel_dims import ParallelDims

log = logging.getLogger(__name__)


def _mesh_spec(mesh, hardware: str | None) -> ParallelDims:
    try:
        return _as_parallel_dims(mesh, hardware)
    except MeshNameError:
        raise
    except MeshError as e:  # a malformed shape: autoplan's argument error, naming the argument
        raise InvalidArgumentError(f"autoplan: mesh={mesh!r}: {e}") from None


def _as_parallel_dims(mesh, hardware: str | None) -> ParallelDims:
    if isinstance(mesh, ParallelDims):
        return mesh if hardware is None else ParallelDims(mesh.shape, mesh.names, hardware, mesh.devices_per_node)
    if isinstance(mesh, dict):
        if "shape" not in mesh or "names" not in mesh:
            raise InvalidArgumentError(f"autoplan: mesh dict {mesh!r} needs 'shape' and 'names'")
        spec = ParallelDims(tuple(mesh["shape"]), tuple(mesh["names"]), mesh.get("hardware", hardware or "h100_sxm"),
                            mesh.get("devices_per_node"))
        return spec if hardware is None else ParallelDims(spec.shape, spec.names, hardware, spec.devices_per_node)
    if isinstance(mesh, DeviceMesh):
        return ParallelDims.from_device_mesh(mesh, hardware)
    raise InvalidArgumentError(f"autoplan: mesh must be a device count (int), a DeviceMesh, a ParallelDims (MeshSpec) "
                               f"or a dict, got {type(mesh).__name__}")


def autoplan(model: torch.nn.Module, mesh, *, inputs: Any = None, batch: Any = None, hardware: str | None = None,
             memory_limit: float | None = None, dtype: torch.dtype | None = None, fsdp: bool | None = None,
             allow_replicated_units: bool = True, activation_checkpointing: bool | None = None,
             sequence_parallel: bool | None = None,
             graph=None, styles: dict | None = None, compile: bool | str = False, overlap: str | None = None,
             precision: str | None = None, **cluster_options: Any) -> Plan:
    """Choose every module's tensor-parallel style for ``model`` on ``mesh``.

    Args:
        batch: ``(global_batch, seq_len)``; each dp rank gets ``global_batch / dp`` sequences.
        inputs: instead of ``batch``, example inputs of one rank (local batch).
        hardware: hardware profile name (default: the mesh's, h100_sxm offline, cpu for CPU meshes).
        memory_limit: bytes per rank (default: the hardware's usable memory, capacity less its stated reserve and fragmentation; ``float('inf')``: none).
        dtype: training dtype (default bf16 on accelerators, fp32 on cpu; "bf16"-style names accepted).
        fsdp: shard parameters/gradients/optimizer over the dp dimension (FSDP2) when dp > 1
            (None: yes on a mesh; the search's choice for a device count).
        allow_replicated_units: if False, every attention/MLP/embedding/head must be sharded
            (raises InfeasiblePlanError naming the violated divisibility when impossible).
        activation_checkpointing: full checkpointing of every repeated block; None lets the
            planner choose (it does when activations would not fit, or it is faster).
        sequence_parallel: force (True) or forbid (False) a sequence-sharded residual stream;
            None lets the planner choose.
        graph: a ModelGraph already captured for this batch (skips capture).
        styles: instead of solving, price this hand-written plan ({pattern: ParallelStyle or
            style dict}, e.g. the torchtitan plan): the Plan then carries its predicted cost,
            collectives and memory, comparable with the planner's own.
        compile: price what compiled code runs (True / "blocks": each repeated block compiled on
            its own, as torchtitan does; "model": the whole model; False / "none": eager), its
            elementwise chains fused (cost_models.fusion); ``plan.predictions["compile"]`` says which.
        overlap: "async_tp" prices a sequence-parallel plan's tensor-parallel collectives fused with
            their matmuls, as inductor's micro-pipeline TP runs them (docs/overlap.md); the plan
            then trains fastest with ``compile={"mode": "blocks", "async_tp": True}`` on CUDA.
            None / "none": every tensor-parallel collective exposed.
        precision: what the Linears train in (docs/float8.md): None / "bf16" the model's own
            dtype; "auto" float8 for each Linear where the hardware makes it pay (never on hardware
            without a float8 GEMM); "fp8-tensorwise" / "fp8-rowwise" float8 wherever it can run.
            The plan's ``parallel["precision"]`` lists each module's choice and why.
        cluster_options: with a device count instead of a mesh, ``autoplan`` is
            :func:`autoplan.cluster.plan_cluster` and takes its keywords too (``constraints``,
            ``schedules``, ...); with a mesh they are a TypeError, as is any unknown keyword.

    Every argument is checked before anything is captured; a bad one raises
    :class:`~autoplan.errors.InvalidArgumentError` (or MeshNameError for mesh names).
    """
    if isinstance(mesh, numbers.Integral) and not isinstance(mesh, bool):
        unknown = set(cluster_options) - CLUSTER_ONLY
        if unknown:
            raise TypeError(f"autoplan() got unexpected keyword argument(s) {sorted(unknown)}; "
                            f"with a device count it also takes {sorted(CLUSTER_ONLY)}")
        return plan_cluster(model, int(mesh), inputs=inputs, batch=batch, hardware=hardware, memory_limit=memory_limit,
                            dtype=dtype, fsdp=fsdp, allow_replicated_units=allow_replicated_units,
                            activation_checkpointing=activation_checkpointing, sequence_parallel=sequence_parallel,
                            graph=graph, styles=styles, compile=compile, overlap=overlap, precision=precision,
                            **cluster_options)
    if cluster_options:
        raise TypeError(f"autoplan() got unexpected keyword argument(s) {sorted(cluster_options)} for a mesh; "
                        "plan_cluster's options (constraints, schedules, ...) apply only with a device count")
    who = "autoplan"
    A.check_model(model, who)
    A.check_batch(batch, who, required=False)
    spec = _mesh_spec(mesh, A.check_hardware(hardware, who))
    for role in ("pp",):
        name = spec.dim(role)
        if name is not None and spec.degree(name) > 1:
            raise InvalidArgumentError(
                f"autoplan: mesh {dict(zip(spec.names, spec.shape))} has {name}={spec.degree(name)}; a mesh plan "
                "covers tensor, context, expert and data parallelism; for pipeline parallelism give a device count "
                "(autoplan(model, N, batch=..., constraints={'pp': ...}))")
    request = PlanRequest.for_mesh(who, hardware=spec.hardware, inputs=inputs, batch=batch, memory_limit=memory_limit,
                                   dtype=dtype, fsdp=fsdp, allow_replicated_units=allow_replicated_units,
                                   activation_checkpointing=activation_checkpointing,
                                   sequence_parallel=sequence_parallel, compile=compile, overlap=overlap,
                                   precision=precision)
    return plan_mesh(model, spec, request, graph=graph, styles=A.check_styles(styles, who))
