"""verify for pipelined plans (pp > 1): pipeline rank 0's issued collectives vs the plan's.

Same method as dry_run.py (fake process group at the plan's world size, rank 0, meta model,
FakeTensorMode, CollectiveRecorder), but the step is the pipeline schedule's: the plan is
applied with apply_pipeline_plan, rank 0's stages get fake storage, one warm-up step runs
unrecorded (the runtime's first step infers boundary shapes: an extra forward and a shape
hand-shake), then one recorded step. Compared exactly per (kind, mesh dim, bytes) with counts:
TP collectives of rank 0's stages, FSDP per unit, the P2P sends and receives of its stage
boundaries and the runtime's per-step signature all-reduce.

What is not compared: the phase (forward/backward interleave in a pipeline step and the
recorder's phase marker only follows autograd), and which group a P2P op ran on (the recorder
does not name the group of send/recv or of the signature all-reduce; they are attributed to
pp, the only group the schedule talks on). Parameter bytes on rank 0 are compared exactly.
Only schedules that place a single stage on rank 0 (GPipe, 1F1B, ZeroBubble) can be dry-run:
a later stage on rank 0 receives boundary shapes from another rank at the first step, which a
fake group cannot deliver; Interleaved1F1B and ZBV raise AutoplanError saying so.
"""
from __future__ import annotations

import logging

import pandas as pd
import torch

from autoplan.errors import AutoplanError
from autoplan.verify.dry_run import VerifyResult, _dtype, _local, _meta_copy, dry_batch

log = logging.getLogger(__name__)
KEY = ["kind", "mesh_dim", "bytes"]


def issued_pipeline_collectives(plan, model: torch.nn.Module, inputs=None) -> tuple[pd.DataFrame, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel.testing import fake_world
    from hyper_parallel.testing.comm_counts import CollectiveRecorder

    shape, names = tuple(plan.mesh["shape"]), tuple(plan.mesh["names"])
    world = 1
    for s in shape:
        world *= s
    meta = _meta_copy(model, _dtype(plan))
    with fake_world(world):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        groups = {mesh.get_group(n).group_name: n for n in names}
        runner = plan.apply(meta, mesh, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
        pbytes = sum(_local(p).numel() * _local(p).element_size() for st in runner.stages
                     for p in st.module.parameters())
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            for st in runner.stages:
                st.module.to_empty(device="cpu")
        dp = mesh[plan.dp_dim].size() if plan.dp_dim else 1
        with fake:
            inputs, targets = dry_batch(plan, dp, inputs)
            args = (inputs,) if runner.first else ()
            tgt = targets if runner.last else None
            runner.schedule.step(*args, target=tgt)   # warm-up: shape inference
            with CollectiveRecorder() as rec:
                runner.schedule.step(*args, target=tgt)
                runner.data_parallel_step()   # replicated dp's all-reduce / ZeRO-1, as PipelineRunner.step
    rows = [dict(e, mesh_dim=groups.get(e["group"], "pp")) for e in rec.events]
    df = pd.DataFrame(rows, columns=["kind", "bytes", "mesh_dim"])
    issued = df.groupby(KEY).size().reset_index(name="issued") if len(df) else pd.DataFrame(columns=KEY + ["issued"])
    return issued, int(pbytes)


def verify_pipeline(plan, model: torch.nn.Module, inputs=None) -> VerifyResult:
    """Dry-run pipeline rank 0 of ``plan``; ``passed`` only when every (kind, dim, bytes) count
    and the parameter bytes agree exactly."""
    s2r = plan.pipeline.get("stage_to_rank") or []
    if [s for s, r in enumerate(s2r) if r == 0] != [0]:
        raise AutoplanError(
            f"verify: pipeline rank 0 of this {plan.pipeline['schedule']} plan holds stages "
            f"{[s for s, r in enumerate(s2r) if r == 0]}; the fake process group cannot carry the "
            "runtime's boundary-shape exchange to a later stage, so only schedules with one stage per "
            "rank (GPipe, 1F1B, ZeroBubble) are dry-run verified")
    issued, pbytes = issued_pipeline_collectives(plan, model, inputs)
    pred = pd.DataFrame(plan.predictions["collectives"])
    if pred.empty:
        pred = pd.DataFrame(columns=KEY + ["count"])
    pred = pred.groupby(KEY)["count"].sum().reset_index(name="predicted")
    df = pred.merge(issued, on=KEY, how="outer").fillna({"predicted": 0, "issued": 0})
    df["predicted"] = df["predicted"].astype(int)
    df["issued"] = df["issued"].astype(int)
    df["match"] = df["predicted"] == df["issued"]
    df = df.sort_values(KEY).reset_index(drop=True)
    want = plan.pipeline.get("rank0_param_bytes")
    want = int(want) if want is not None else pbytes
    passed = bool(df["match"].all()) and want == pbytes
    return VerifyResult(df, {"predicted": want, "issued": pbytes}, passed)
