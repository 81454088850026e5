"""Run on every rank of a gloo RankPool: pipeline schedules built with arguments that differ
between ranks must fail fast with a ScheduleError naming both values, not hang."""
from __future__ import annotations

import time

import torch.distributed as dist

from hyper_parallel.core.pipeline_parallel import Schedule1F1B, ScheduleGPipe, build_stages
from hyper_parallel.errors import ScheduleError
from tests.pipeline.workers import build_model, data, lm_loss


def disagreeing_schedules() -> list[tuple[str, str, float]]:
    """(case, error type and message, seconds to fail) per case on this rank."""
    rank, p = dist.get_rank(), dist.get_world_size()
    out = []
    cases = [
        ("microbatches", Schedule1F1B, Schedule1F1B, 2, 4),
        ("schedule", ScheduleGPipe, Schedule1F1B, 2, 2),
    ]
    for case, cls0, cls1, m0, m1 in cases:
        cls, m = (cls0, m0) if rank == 0 else (cls1, m1)
        model = build_model("titan", False, 2)
        stages = build_stages(model, cls.ir(p, m))
        sched = cls(stages, m, lm_loss)
        x, y = data(4, 8)
        t0 = time.monotonic()
        try:
            sched.step(x, target=y)
            out.append((case, "no error", time.monotonic() - t0))
        except ScheduleError as e:
            out.append((case, f"ScheduleError: {e}", time.monotonic() - t0))
    # and agreeing ranks still train (the check is not a false alarm)
    model = build_model("titan", False, 2)
    stages = build_stages(model, Schedule1F1B.ir(p, 2))
    loss = Schedule1F1B(stages, 2, lm_loss).step(*data(4, 8)[:1], target=data(4, 8)[1])
    out.append(("agree", "ok" if (loss is None) == (rank == 0) else f"loss {loss}", 0.0))
    return out
