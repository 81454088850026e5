"""Time a schedule without torch: what the planner uses to choose cuts, schedule and micro-batches.

``simulate(schedule, stage_costs, p2p_time)`` plays the same lowered IR the executor runs, with
per-stage forward / backward-input / backward-weight times, and returns per-rank timelines.

Bubble fraction (the definition in formulas.md, Megatron's): idle time over useful time,
``(T_step - T_busy) / T_busy`` on the busiest rank, where T_busy is that rank's compute time. For
uniform stages this is (p-1)/m for GPipe and 1F1B, (p-1)/(v m) for interleaved 1F1B and (p-1)/(3m)
for ZB-H1 when T_F = T_B = T_W (with p2p_time = 0).

In-flight micro-batches: on each rank, the (stage, micro-batch) chunks whose forward has run and
whose last backward piece (B, or W when split) has not: the activations the rank must hold.

MPipe schedules (mpipe_ir.py) also take ``preprocess_cost``: the tower's StageCost per micro-batch
(PRE_F costs ``forward``, PRE_B ``backward``), and ``reduce_time``: the tower-gradient all-reduce
(REDUCE_PRE, a collective that starts when every rank reaches it). The step-time formulas of MPipe
vs the tower on stage 0 are in mpipe_ir.py and checked in tests/pipeline/test_mpipe_ir.py.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

from hyper_parallel.core.pipeline_parallel.playback import play
from hyper_parallel.core.pipeline_parallel.schedule_ir import ActionKind, PipelineSchedule, peak_inflight
from hyper_parallel.core.pipeline_parallel.validator import validate_schedule
from hyper_parallel.errors import ScheduleError

K = ActionKind


@dataclass(frozen=True)
class StageCost:
    """Seconds (or any unit) one micro-batch spends in a stage: forward, dx and dw backward.

    A full backward (B) costs ``backward_input + backward_weight``.
    """

    forward: float
    backward_input: float
    backward_weight: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                raise ScheduleError(f"StageCost: {name}={v!r} must be a finite number >= 0 (a time)")

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight


@dataclass
class SimResult:
    """Simulated step. ``timeline`` has one row per action: rank, step, action, kind, stage,
    microbatch, start, end."""

    schedule: str
    step_time: float
    bubble_fraction: float
    busy: list[float]
    peak_inflight: list[int]
    timeline: "object"  # pandas.DataFrame

    def summary(self) -> dict:
        return dict(schedule=self.schedule, step_time=self.step_time,
                    bubble_fraction=self.bubble_fraction, peak_inflight=max(self.peak_inflight))


def _costs(stage_costs, n_stages: int) -> list[StageCost]:
    if isinstance(stage_costs, StageCost):
        return [stage_costs] * n_stages
    costs = list(stage_costs)
    if len(costs) != n_stages:
        raise ScheduleError(f"simulate: got {len(costs)} stage costs for {n_stages} stages")
    for i, c in enumerate(costs):
        if not isinstance(c, StageCost):
            try:
                costs[i] = StageCost(*c)
            except ScheduleError as e:
                raise ScheduleError(f"simulate: stage {i}: {e}") from None
            except TypeError:
                raise ScheduleError(f"simulate: stage {i} cost {c!r} must be a StageCost or "
                                    "(forward, backward_input[, backward_weight])") from None
    return costs


def simulate(schedule: PipelineSchedule, stage_costs: StageCost | Sequence[StageCost],
             p2p_time: float = 0.0, preprocess_cost: StageCost | None = None,
             reduce_time: float = 0.0) -> SimResult:
    """Validate, then time ``schedule``; ``stage_costs`` is one StageCost or one per stage."""
    import pandas as pd

    lowered = validate_schedule(schedule)
    costs = _costs(stage_costs, lowered.n_stages)
    if lowered.meta.get("preprocess") and preprocess_cost is None:
        raise ScheduleError(f"simulate: {lowered.name} runs a preprocess tower; give preprocess_cost="
                            "StageCost(tower forward, tower backward)")
    if preprocess_cost is not None and not isinstance(preprocess_cost, StageCost):
        raise ScheduleError(f"simulate: preprocess_cost={preprocess_cost!r} must be a StageCost")
    if isinstance(reduce_time, bool) or not isinstance(reduce_time, numbers.Real) or \
            not math.isfinite(reduce_time) or reduce_time < 0:
        raise ScheduleError(f"simulate: reduce_time={reduce_time!r} must be a finite number >= 0")
    if isinstance(p2p_time, bool) or not isinstance(p2p_time, numbers.Real) or not math.isfinite(p2p_time) \
            or p2p_time < 0:
        raise ScheduleError(f"simulate: p2p_time={p2p_time!r} must be a finite number >= 0")

    def duration(a) -> float:
        if a.kind is K.PRE_F:
            return preprocess_cost.forward
        if a.kind is K.PRE_B:
            return preprocess_cost.backward
        if a.kind is K.REDUCE_PRE:
            return reduce_time
        c = costs[a.stage]
        return {K.FORWARD: c.forward, K.BACKWARD: c.backward, K.BACKWARD_INPUT: c.backward_input,
                K.BACKWARD_WEIGHT: c.backward_weight}.get(a.kind, 0.0)

    events = play(lowered, duration, p2p_time)
    step_time = max((e.end for evs in events for e in evs), default=0.0)
    busy = [sum(e.end - e.start for e in evs if e.action.is_compute) for evs in events]
    top = max(busy) if busy else 0.0
    bubble = (step_time - top) / top if top > 0 else 0.0
    peaks = [peak_inflight(e.action for e in evs) for evs in events]
    rows = [dict(rank=e.rank, step=e.step, action=str(e.action), kind=e.action.kind.value,
                 stage=e.action.stage, microbatch=e.action.microbatch, start=e.start, end=e.end)
            for evs in events for e in evs]
    timeline = pd.DataFrame(rows, columns=["rank", "step", "action", "kind", "stage", "microbatch",
                                           "start", "end"])
    return SimResult(lowered.name, step_time, bubble, busy, peaks, timeline)
