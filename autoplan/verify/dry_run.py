"""verify(plan, model): apply a plan at its real world size on one CPU and compare what the
runtime issues with what the plan predicted.

A fake process group of the plan's world size stands in for the cluster; the model is sharded
on meta and rank 0's shards become fake CPU tensors; the step runs under FakeTensorMode -- no
FLOPs, no memory -- so a 70B plan for 512 ranks is checked in seconds. One training forward and
backward runs under CollectiveRecorder; every collective is attributed to the mesh dimension
whose process group it ran on, and the per-rank parameter bytes are read off the sharded model.
Predicted and issued must agree exactly: kind, mesh dimension, phase, bytes and count.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import pandas as pd
import torch

from autoplan.errors import AutoplanError
from autoplan.plan.plan import Plan

log = logging.getLogger(__name__)
KEY = ["kind", "mesh_dim", "phase", "bytes"]


@dataclass
class VerifyResult:
    collectives: pd.DataFrame     # KEY + predicted, issued, match
    param_bytes: dict[str, int]   # predicted / issued per rank (rank 0)
    passed: bool

    def mismatches(self) -> pd.DataFrame:
        return self.collectives[~self.collectives["match"]]


def _meta_copy(model: torch.nn.Module, dtype: torch.dtype | None) -> torch.nn.Module:
    from autoplan.capture.inputs import meta_model

    out = meta_model(model, dtype)
    return copy.deepcopy(out) if out is model else out


def _dtype(plan: Plan) -> torch.dtype:
    if (plan.fsdp or {}).get("mixed_precision"):
        return torch.float32   # parameters are fp32 master weights; the policy casts for compute
    name = str(plan.batch.get("dtype", "torch.float32")).replace("torch.", "")
    return getattr(torch, name)


def issued_collectives(plan: Plan, model: torch.nn.Module, inputs=None) -> tuple[pd.DataFrame, int]:
    """Apply ``plan`` to a meta copy of ``model`` on a fake group of the plan's world size, run one
    forward/backward, return (issued collectives by KEY with counts, parameter bytes on rank 0)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.plan.runner import _logits, lm_loss
    from hyper_parallel.testing import fake_world
    from hyper_parallel.testing.comm_counts import CollectiveRecorder

    shape, names = tuple(plan.mesh["shape"]), tuple(plan.mesh["names"])
    world = 1
    for s in shape:
        world *= s
    dtype = _dtype(plan)
    meta = _meta_copy(model, dtype)
    with fake_world(world):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = {mesh.get_group(n).group_name: n for n in names}
        # shard on meta, then give this rank's shards fake CPU storage: the step runs under
        # FakeTensorMode, so no FLOPs, no parameter or activation memory
        runner = plan.apply(meta, mesh)
        pbytes = sum(_local(p).numel() * _local(p).element_size() for p in meta.parameters())
        dp = mesh[plan.dp_dim].size() if plan.dp_dim else 1
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            meta.to_empty(device="cpu")
        if hasattr(meta, "_get_fsdp_state"):
            meta._get_fsdp_state()._lazy_init()
        with fake:
            inputs, targets = dry_batch(plan, dp, inputs)
            with CollectiveRecorder() as rec:
                rec.phase = "forward"
                logits = _logits(meta(inputs))
                if plan.loss_parallel:
                    from hyper_parallel import loss_parallel

                    with loss_parallel():
                        loss = lm_loss(logits, targets)
                        rec.phase = "backward"
                        loss.backward()
                else:
                    loss = lm_loss(logits, targets)
                    rec.phase = "backward"
                    loss.backward()
                runner.data_parallel_step()  # what Runner.step does after backward (all-reduce / ZeRO-1)
    rows = [dict(e, mesh_dim=groups.get(e["group"], f"group:{e['group']}")) for e in rec.events]
    df = pd.DataFrame(rows, columns=["kind", "phase", "bytes", "mesh_dim"])
    issued = df.groupby(KEY).size().reset_index(name="issued") if len(df) else pd.DataFrame(columns=KEY + ["issued"])
    del runner
    return issued, int(pbytes)


def dry_batch(plan: Plan, dp: int, inputs=None):
    """(inputs, targets) of one dp rank: token ids of the plan's batch shape unless given.
    Call under FakeTensorMode: the values never matter, only the shapes."""
    if inputs is None:
        gb, seq = plan.batch.get("global_batch"), plan.batch.get("seq_len")
        if not gb or not seq:
            raise AutoplanError("verify: the plan has no batch shape; pass inputs=")
        inputs = torch.zeros(gb // dp, seq, dtype=torch.long)
    return inputs, torch.zeros(inputs.shape, dtype=torch.long)


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p


def verify(plan: Plan, model: torch.nn.Module, inputs=None) -> VerifyResult:
    """Dry-run ``plan`` at its world size; compare issued collectives and parameter bytes with
    the plan's predictions. ``passed`` is True only when everything agrees exactly."""
    if plan.pipeline and int(plan.pipeline.get("pp", 1)) > 1:
        from autoplan.verify.pipeline_dry_run import verify_pipeline

        return verify_pipeline(plan, model, inputs)
    issued, pbytes = issued_collectives(plan, model, inputs)
    predicted = pd.DataFrame(plan.predictions["collectives"])
    if predicted.empty:
        predicted = pd.DataFrame(columns=KEY + ["count"])
    predicted = predicted.rename(columns={"count": "predicted"})[KEY + ["predicted"]]
    df = predicted.merge(issued, on=KEY, how="outer").fillna({"predicted": 0, "issued": 0})
    df["predicted"] = df["predicted"].astype(int)
    df["issued"] = df["issued"].astype(int)
    df["match"] = df["predicted"] == df["issued"]
    df = df.sort_values(KEY).reset_index(drop=True)
    want = int(round(plan.predictions["memory_bytes"]["params"]))
    passed = bool(df["match"].all()) and want == pbytes
    return VerifyResult(df, {"predicted": want, "issued": pbytes}, passed)
