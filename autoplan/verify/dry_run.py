"""verify(plan, model): apply a plan at its real world size on one CPU and compare what the
runtime issues with what the plan predicted.

A fake process group of the plan's world size stands in for the cluster; the model is sharded
on meta and rank 0's shards become fake CPU tensors; the step runs under FakeTensorMode -- no
FLOPs, no memory -- so a 70B plan for 512 ranks is checked in seconds. One training step's
forwards and backwards (one per micro-batch of gradient accumulation) run under CollectiveRecorder; every collective is attributed to the mesh dimension
whose process group it ran on, and the per-rank parameter bytes are read off the sharded model.
Predicted and issued must agree exactly: kind, mesh dimension, phase, bytes and count.
"""
from __future__ import annotations

import logging
import traceback

import pandas as pd
import torch
from torch.distributed.device_mesh import init_device_mesh

from autoplan.errors import AutoplanError, PlanningError
from autoplan.parallelisms.registry import batch_shards
from autoplan.plan.plan import Plan
from autoplan.verify.async_tp import check_async_tp
from autoplan.verify.even_counts import EvenCounts
from autoplan.verify.dry_common import (KEY, VerifyResult, compare, dry_batch, dry_fake_mode, local_part, mesh_groups,
                                       meta_copy, named_events, plan_dtype)
from autoplan.verify.numerics import check_numerics
from hyper_parallel.local.own_routing import OwnRouting
from autoplan.verify.pipeline_dry_run import verify_pipeline
from autoplan.verify.shrink import ModelRecipe, recipe_for
from hyper_parallel import balanced_routing
from hyper_parallel.local import CollectiveRecorder, fake_world

log = logging.getLogger(__name__)


def issued_collectives(plan: Plan, model: torch.nn.Module, inputs=None) -> tuple[pd.DataFrame, int]:
    """Apply ``plan`` to a meta copy of ``model`` on a fake group of the plan's world size, run one
    step's forwards/backwards, return (issued collectives by KEY with counts, parameter bytes on rank 0)."""
    shape, names = tuple(plan.mesh["shape"]), tuple(plan.mesh["names"])
    world = 1
    for s in shape:
        world *= s
    dtype = plan_dtype(plan)
    meta = meta_copy(model, dtype)
    with fake_world(world):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        # shard on meta, then give this rank's shards fake CPU storage: the step runs under
        # FakeTensorMode, so no FLOPs, no parameter or activation memory
        runner = plan.apply(meta, mesh)
        # the named dimensions and the flattened ones the plan runs on (FSDP over dp x cp / dp x ep)
        groups = mesh_groups(mesh, names)
        pbytes = sum(local_part(p).numel() * local_part(p).element_size() for p in meta.parameters())
        fake = dry_fake_mode()
        with fake:
            meta.to_empty(device="cpu")
        if hasattr(meta, "_get_fsdp_state"):
            meta._get_fsdp_state()._lazy_init()
        with fake:
            # rank 0's share of the global batch, as a step takes it (rows, then sequence chunks), its
            # token ids with their values (OwnRouting): a mask of image tokens made of them has its count
            with OwnRouting():
                inputs, targets = runner.local_batch(*dry_batch(plan, batch_shards(plan), inputs))
            # MoE: a fixed balanced routing, so the all-to-all sizes are the predicted ones
            # (modules routing by counts they read: the balanced router's counts, EvenCounts; modules
            # whose own expert loop indexes by the routing mask, DBRX's: its balanced values, OwnRouting)
            with CollectiveRecorder() as rec, balanced_routing(), EvenCounts(), OwnRouting():
                # Runner.step's passes (one per micro-batch of gradient accumulation), each
                # collective attributed to the phase it ran in
                runner.forward_backward(inputs, targets, on_phase=lambda name: setattr(rec, "phase", name))
                runner.data_parallel_step()  # what Runner.step does after backward (all-reduce / ZeRO-1)
    rows = named_events(rec.events, groups, plan)
    df = pd.DataFrame(rows, columns=["kind", "phase", "bytes", "mesh_dim"])
    issued = df.groupby(KEY).size().reset_index(name="issued") if len(df) else pd.DataFrame(columns=KEY + ["issued"])
    del runner
    return issued, int(pbytes)


def verify(plan: Plan, model: torch.nn.Module, inputs=None, *, numerics: bool = False, factory: str | None = None,
           factory_kwargs: dict | None = None, pool=None) -> VerifyResult:
    """Dry-run ``plan`` at its world size; compare issued collectives and parameter bytes with
    the plan's predictions. ``passed`` is True only when everything agrees exactly.

    With ``numerics=True`` the plan's styles also train one step on a small copy of ``model`` on
    local gloo ranks (``pool``: a RankPool of the plan's world size, else one is started) and must
    equal one device: loss, every gradient, every parameter after the step. The small copy comes
    from the model's Hugging Face config, or from ``factory`` ("package.module:function", called
    with ``factory_kwargs``). A plan that fails to run is ``passed=False`` with the error in
    ``result.numerics.error``; nothing escapes."""
    try:
        result = _verify_collectives(plan, model, inputs)
    except AutoplanError:
        raise  # the arguments are wrong: say so
    except Exception as exc:  # noqa: BLE001 - a plan that does not run is a failed verification
        why = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        result = VerifyResult(pd.DataFrame(columns=KEY + ["parallelism", "predicted", "issued", "match"]), {}, False,
                              error=why)
    degrees = [d for d in plan.mesh["shape"] if d > 1]

    def recipe() -> ModelRecipe:
        return ModelRecipe(factory=factory, kwargs=dict(factory_kwargs or {})) if factory else \
            recipe_for(model, degrees)
    if numerics:
        result.numerics = check_numerics(plan, recipe(), pool=pool)
        result.passed = bool(result.passed and result.numerics.passed)
    if plan.predictions.get("overlap") == "async_tp" and result.error is None:
        # the plan priced its sequence-parallel collectives fused: check torch's pass fuses them
        try:
            result.async_tp = check_async_tp(plan, recipe())
            result.passed = bool(result.passed and result.async_tp.ok)
        except PlanningError as e:   # no small copy to compile (a model without an HF config, no factory)
            result.async_tp = f"not checked: {e}"
    return result


def _verify_collectives(plan: Plan, model: torch.nn.Module, inputs=None) -> VerifyResult:
    if plan.pipeline and int(plan.pipeline.get("pp", 1)) > 1:
        return verify_pipeline(plan, model, inputs)
    issued, pbytes = issued_collectives(plan, model, inputs)
    df = compare(plan, plan.predictions["collectives"], issued)
    want = int(round(plan.predictions["memory_bytes"]["params"]))
    passed = bool(df["match"].all()) and want == pbytes
    return VerifyResult(df, {"predicted": want, "issued": pbytes}, passed)
