"""verify for MPipe (issue 20): every pipeline rank's issued P2P and all-reduces vs the IR's prediction.

The prediction is read off the lowered MPipe schedule, independently of the executor: each
SEND_F / RECV_F / SEND_B / RECV_B moves the stage boundary's tensors, each SEND_PRE / RECV_PRE
the tower output's tensors (every element of a tuple), each SEND_PRE_B / RECV_PRE_B the tensors
of the output that need a gradient, REDUCE_PRE is one all-reduce per dtype of the tower's local
parameter bytes, and every step starts with the runtime's agreement all-reduce. Shapes come from
one device: the tower run on micro-batch 0 and ``local_boundaries`` for the stages.

The dry run initialises a fake process group of ``pp`` ranks as each rank in turn (no data
moves; received buffers hold garbage, which is fine for counting), builds that rank's stages and
the MPipe runtime, runs one step under the CollectiveRecorder and compares (kind, bytes) counts
exactly with the prediction. ``model_fn`` builds the model (the same on every call).
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

import pandas as pd
import torch

from autoplan.errors import AutoplanError
from autoplan.verify.dry_common import VerifyResult
from hyper_parallel.core.pipeline_parallel import (
    Preprocess, build_stages, even_cuts, lower, mpipe, schedule_facts, split_microbatches,
)
from hyper_parallel.core.pipeline_parallel.mpipe import tower_reduce_bytes
from hyper_parallel.core.pipeline_parallel.schedule_ir import ActionKind
from hyper_parallel.core.pipeline_parallel.schedules import AGREEMENT_BYTES
from hyper_parallel.core.pipeline_parallel.shape_inference import local_boundaries
from hyper_parallel.core.pipeline_parallel.stage import flatten
from hyper_parallel.local import CollectiveRecorder, fake_world

log = logging.getLogger(__name__)
K = ActionKind
KEY = ["kind", "bytes"]


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def predicted_mpipe_collectives(ir, boundary_bytes: dict[int, list[int]], tower_out: list[tuple[int, bool]],
                                reduce_bytes: list[int]) -> list[Counter]:
    """Per pipeline rank, Counter{(kind, bytes): count} of one step of the lowered MPipe ``ir``.

    ``boundary_bytes[s]``: bytes of each tensor entering stage s; ``tower_out``: (bytes, needs
    grad) of each tower output tensor; ``reduce_bytes``: one all-reduce per entry (per dtype)."""
    lowered = ir if ir.is_lowered else lower(ir)
    out = []
    for prog in lowered.actions:
        c: Counter = Counter({("all_reduce", AGREEMENT_BYTES): 1})
        for a in prog:
            if a.kind in (K.SEND_F, K.RECV_B):
                sizes = boundary_bytes[a.stage + 1]
            elif a.kind in (K.RECV_F, K.SEND_B):
                sizes = boundary_bytes[a.stage]
            elif a.kind in (K.SEND_PRE, K.RECV_PRE):
                sizes = [b for b, _ in tower_out]
            elif a.kind in (K.SEND_PRE_B, K.RECV_PRE_B):
                sizes = [b for b, g in tower_out if g]
            elif a.kind is K.REDUCE_PRE:
                for b in reduce_bytes:
                    c[("all_reduce", b)] += 1
                continue
            else:
                continue
            for b in sizes:
                c[("send_recv", b)] += 1
        out.append(c)
    return out


def verify_mpipe(model_fn: Callable[[], torch.nn.Module], tokens: torch.Tensor, pixel_values: torch.Tensor,
                 targets: torch.Tensor, pp: int, n_microbatches: int, schedule: str = "1F1B",
                 placement: str = "front", loss_fn: Callable | None = None) -> VerifyResult:
    """Dry-run every pipeline rank of a VL model (``model.visual`` the tower) under MPipe;
    ``passed`` when each rank's (kind, bytes) counts equal the IR's prediction exactly."""
    if loss_fn is None:
        def loss_fn(logits, y):
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    facts = schedule_facts(schedule)
    base = facts.schedule_class.ir(pp, n_microbatches)
    ir = lower(mpipe(base, placement))
    model = model_fn()
    if not hasattr(model, "visual"):
        raise AutoplanError(f"verify_mpipe: {type(model).__name__} has no `visual` tower; MPipe needs one")
    cuts = even_cuts(model, ir.n_stages)
    mb_args, _ = split_microbatches((tokens,), {}, n_microbatches)
    _, pv = split_microbatches((), {"pixel_values": pixel_values}, n_microbatches)
    with torch.no_grad():
        tower = flatten(model.visual(**pv[0]), "verify_mpipe tower")
    with torch.enable_grad():
        needs = [t.requires_grad for t in flatten(model.visual(**pv[0]), "verify_mpipe tower")]
    tower_out = [(_nbytes(t.shape, t.dtype), g) for t, g in zip(tower, needs)]
    metas = local_boundaries(model, cuts, None, mb_args[0],
                             {"vision": tower[0] if len(tower) == 1 else tuple(tower)})
    boundary_bytes = {s: [_nbytes(m.shape, m.dtype) for m in ms] for s, ms in metas.items()}
    reduce_bytes = list(tower_reduce_bytes(model.visual).values())
    want = predicted_mpipe_collectives(ir, boundary_bytes, tower_out, reduce_bytes)
    tables, passed = [], True
    for r in range(pp):
        with fake_world(pp, rank=r):
            m = model_fn()
            stages = build_stages(m, base, cuts=cuts)
            sched = facts.schedule_class(stages, n_microbatches, loss_fn, boundary_metas=metas,
                                         preprocess=Preprocess(m.visual, ("pixel_values",), placement=placement))
            first = any(s.stage_index == 0 for s in stages)
            last = any(s.stage_index == ir.n_stages - 1 for s in stages)
            with CollectiveRecorder() as rec:
                sched.step(*((tokens,) if first else ()), target=targets if last else None,
                           pixel_values=pixel_values)
        issued = Counter((e["kind"], int(e["bytes"])) for e in rec.events)
        keys = sorted(set(issued) | set(want[r]))
        df = pd.DataFrame([dict(pp_rank=r, kind=k, bytes=b, predicted=want[r][(k, b)], issued=issued[(k, b)])
                           for k, b in keys])
        df["match"] = df["predicted"] == df["issued"]
        passed = passed and bool(df["match"].all())
        tables.append(df)
        log.info("verify_mpipe rank %d/%d: match=%s", r, pp, bool(df["match"].all()))
    table = pd.concat(tables, ignore_index=True)
    return VerifyResult(table, {}, passed)
