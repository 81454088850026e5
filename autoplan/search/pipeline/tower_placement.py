"""Where a VL model's preprocess tower goes in the pipeline: on stage 0, as its own stage(s), or MPipe.

Each option is priced on the schedule IR the runtime executes (``simulate``), with the tower's
time and memory:

- ``stage0``: the tower is part of stage 0 (the decoder cuts are rebalanced with the tower's cost
  in unit 0). Stage 0 holds the tower's parameters and, per in-flight micro-batch, its activations.
- ``own_stage``: the tower's units are the first k stages (k = 1 .. p-1, the best is kept), the
  decoder the remaining p-k. (Priced only: the runtime's split has no spine that puts tower units
  into stages yet; the plan would have to carry the token ids through the tower stages.)
- ``mpipe``: every rank holds the tower; micro-batch mb's tower runs on its owner
  (``mpipe_ir.mpipe``, "front" placement: each owner keeps ceil(m/p) tower graphs for the step),
  plus the tower-gradient all-reduce (``tower_reduce_s``) at the end.

The fastest option that fits ``memory_limit`` on every rank wins; all are returned, priced, so a
review can show the alternatives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from autoplan.errors import InfeasiblePlanError
from autoplan.search.pipeline.search import UnitCost, balanced_cuts, stage_bounds
from hyper_parallel.core.pipeline_parallel import StageCost, mpipe, schedule_facts, simulate
from hyper_parallel.errors import ScheduleError

PLACEMENTS = ("stage0", "own_stage", "mpipe")


@dataclass
class TowerChoice:
    """One priced placement: the simulated step time, each rank's memory and whether it fits."""

    placement: str
    step_s: float
    rank_memory: list[float]
    fits: bool
    starts: list[int] = field(default_factory=list)   # stage starts over the units the stages hold
    tower_stages: int = 0                               # own_stage: stages given to the tower

    def to_dict(self) -> dict:
        return dict(placement=self.placement, step_s=self.step_s, peak_memory=max(self.rank_memory),
                    fits=self.fits, tower_stages=self.tower_stages)


def _sum(units: Sequence[UnitCost]) -> UnitCost:
    return UnitCost("+".join(u.name for u in units), sum(u.forward for u in units),
                    sum(u.backward_input for u in units), sum(u.backward_weight for u in units),
                    sum(u.state_bytes for u in units), sum(u.act_bytes for u in units))


def _stage_costs(units: Sequence[UnitCost], starts: Sequence[int]) -> list[UnitCost]:
    return [_sum(units[a:b]) for a, b in stage_bounds(starts, len(units))]


def _cuts(units: Sequence[UnitCost], n: int, inflight: Sequence[float]) -> list[int]:
    starts = balanced_cuts([u.time for u in units], [0.0] * len(units), [0.0] * len(units), n,
                           inflight, [math.inf] * n)
    if starts is None:
        raise InfeasiblePlanError(f"tower placement: {len(units)} units cannot fill {n} stages")
    return starts


def _timed(schedule, stages: Sequence[UnitCost], p2p_time: float, **kw) -> float:
    costs = [StageCost(s.forward, s.backward_input, s.backward_weight) for s in stages]
    return simulate(schedule, costs, p2p_time, **kw).step_time


def choose_tower_placement(tower: Sequence[UnitCost] | UnitCost, units: Sequence[UnitCost], p: int, m: int,
                           schedule: str = "1F1B", p2p_time: float = 0.0, tower_reduce_s: float = 0.0,
                           memory_limit: float = math.inf) -> list[TowerChoice]:
    """All three placements for ``tower`` (its units, or one UnitCost) in front of the decoder
    ``units`` on ``p`` pipeline ranks with ``m`` micro-batches, fastest fitting first. ``schedule``
    must have one stage per rank (1F1B, GPipe, ZeroBubble)."""
    tower = [tower] if isinstance(tower, UnitCost) else list(tower)
    units = list(units)
    facts = schedule_facts(schedule)
    if facts.stages_per_rank(1) != 1:
        raise ScheduleError(f"choose_tower_placement: schedule={schedule!r} has several stages per rank; "
                            "use one with one stage per rank (1F1B, GPipe, ZeroBubble)")
    if not tower or not units:
        raise InfeasiblePlanError("choose_tower_placement: needs the tower's units and the decoder's units")
    if p < 2:
        raise InfeasiblePlanError(f"choose_tower_placement: p={p}; a pipeline needs at least 2 ranks")
    base = facts.ir(p, m, 1)   # one stage per rank (an interleaved schedule at v=1)
    inflight = list(facts.inflight(p, m))
    whole = _sum(tower)
    out: list[TowerChoice] = []

    # tower on stage 0: one unit sequence with the tower folded into the first unit
    merged = [_sum([whole, units[0]])] + units[1:]
    starts = _cuts(merged, p, inflight)
    stages = _stage_costs(merged, starts)
    mem = [s.state_bytes + inflight[j] * s.act_bytes for j, s in enumerate(stages)]
    out.append(TowerChoice("stage0", _timed(base, stages, p2p_time), mem, max(mem) <= memory_limit, starts))

    # tower as its own k stages
    best = None
    for k in range(1, min(p - 1, len(tower)) + 1):
        ts = _cuts(tower, k, inflight[:k])
        ds = _cuts(units, p - k, inflight[k:])
        stages = _stage_costs(tower, ts) + _stage_costs(units, ds)
        mem = [s.state_bytes + inflight[j] * s.act_bytes for j, s in enumerate(stages)]
        choice = TowerChoice("own_stage", _timed(base, stages, p2p_time), mem, max(mem) <= memory_limit,
                             ts + [len(tower) + d for d in ds], tower_stages=k)
        if best is None or (choice.fits, -choice.step_s) > (best.fits, -best.step_s):
            best = choice
    if best is not None:
        out.append(best)

    # MPipe: decoder cut over all p stages, the tower everywhere
    starts = _cuts(units, p, inflight)
    stages = _stage_costs(units, starts)
    per_rank = math.ceil(m / p)
    mem = [s.state_bytes + whole.state_bytes + inflight[j] * s.act_bytes + per_rank * whole.act_bytes
           for j, s in enumerate(stages)]
    step = _timed(mpipe(base), stages, p2p_time,
                  preprocess_cost=StageCost(whole.forward, whole.backward_input + whole.backward_weight),
                  reduce_time=tower_reduce_s)
    out.append(TowerChoice("mpipe", step, mem, max(mem) <= memory_limit, starts))
    return sorted(out, key=lambda c: (not c.fits, c.step_s))
