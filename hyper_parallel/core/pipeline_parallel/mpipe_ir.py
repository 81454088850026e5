"""MPipe as a schedule-IR transform: any schedule's compute order plus the preprocess tower.

MPipe is for models with a heavy "preprocess" tower in front of the decoder (the vision encoder
of a VL model). A plain pipeline puts the tower on stage 0, which then costs every rank the
tower's time per micro-batch (stage 0 is the bottleneck). MPipe runs the tower of micro-batch mb
on its owner rank (``preprocess_owner``: round-robin over the pipeline ranks, micro-batch 0 on
stage 0's rank), "transposes" the output to stage 0's rank, keeps the tower's autograd graph on
the owner, gets the gradient of the output back after stage 0's backward, runs the tower backward
there, and at the end sums the tower's parameter gradients over the pipeline ranks (REDUCE_PRE).

:func:`mpipe` inserts PRE_F / PRE_B into the owners' programs of a compute-only schedule (1F1B,
Interleaved1F1B, ZeroBubble, ...); :func:`~schedule_ir.lower` then adds the transposed P2P and
REDUCE_PRE, and the validator, the simulator and the executor read the result like any schedule.

Where the tower actions go: the base schedule is timed with ``stage_costs`` (default: unit costs)
and the owner runs PRE_F(mb) just before its first action that starts at or after
``start(F(0, mb)) - lead`` (``lead`` defaults to the tower's forward time, so the output is ready
when stage 0 wants it) and PRE_B(mb) just before its first action starting at or after the end of
stage 0's backward (B or I) of mb. Both placements are deadlock-free: PRE_F depends on nothing, so
it may sit anywhere before its consumer; PRE_B only waits for stage 0's backward of mb, and every
action placed before it started before that backward ended in the base timeline, so none of them
can depend on it (the validator replays the result anyway). Nothing here imports torch.

Step time (what the simulator gives, checked exactly in tests/pipeline/test_mpipe_ir.py): 1F1B,
p ranks, m micro-batches (m a multiple of p), uniform stage costs t_f / t_b, tower t_v forward and
t_vb backward per micro-batch, p2p and reduction time 0:

    tower on stage 0:   T_0 = m (t_f + t_b + t_v + t_vb) + (p - 1) [max(0, t_b - t_v) + max(0, t_f - t_vb)]
        (stage 0 is the bottleneck and idles twice: after its warm-up forwards, waiting for the first
        gradient, and before its last backward, waiting for the last micro-batch's round trip)
    MPipe, "front":     T_M = (m + p - 1)(t_f + t_b) + (m / p)(t_v + t_vb)
        (every owner first runs its m/p tower forwards -- stage 0 starts (m/p) t_v late, and the
        1F1B pipeline then runs unperturbed -- and last its m/p tower backwards, the last of which
        can only start when stage 0's final backward is done: rank 0's tail is (m/p) t_vb)

    T_0 - T_M = (p - 1) [(m/p)(t_v + t_vb) - (t_f + t_b) + max(0, t_b - t_v) + max(0, t_f - t_vb)]

so MPipe wins as soon as the tower's work per micro-batch, spread over the p ranks, exceeds one
stage's bubble share; GPipe follows the same T_M.
"""
from __future__ import annotations

from typing import Sequence

from hyper_parallel.core.pipeline_parallel.playback import play
from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    PB, PF, Action, ActionKind, PipelineSchedule, lower, preprocess_owner,
)
from hyper_parallel.errors import ScheduleError

K = ActionKind


def _unit(a: Action) -> float:
    return {K.FORWARD: 1.0, K.BACKWARD: 2.0, K.BACKWARD_INPUT: 1.0, K.BACKWARD_WEIGHT: 1.0}.get(a.kind, 0.0)


PLACEMENTS = ("front", "timed")


def mpipe(schedule: PipelineSchedule, placement: str = "front", stage_costs: Sequence | None = None,
          tower_cost: tuple[float, float] | None = None, lead: float | None = None) -> PipelineSchedule:
    """``schedule`` (compute actions only) with the tower of every micro-batch on its owner rank.

    ``placement="front"``: each owner runs all its tower forwards first and all its tower
    backwards last (the step-time formula above; every owner holds ceil(m/p) tower graphs for
    the whole step). ``"timed"``: just in time, as described above (fewer live tower graphs).

    ``stage_costs``: per stage (forward, backward_input[, backward_weight]) used to place the tower
    actions (default: unit costs, F=1, B=2, I=W=1). ``tower_cost``: (forward, backward) of the
    tower in the same unit; ``lead`` (default: the tower's forward time) is how long before stage
    0 wants micro-batch mb its owner starts the tower.
    """
    if schedule.meta.get("preprocess"):
        raise ScheduleError(f"mpipe: {schedule.name} already runs the tower with MPipe")
    if placement not in PLACEMENTS:
        raise ScheduleError(f"mpipe: placement={placement!r}; valid: {list(PLACEMENTS)}")
    if schedule.is_lowered:
        schedule = schedule.compute_only()
    s2r = schedule.stage_to_rank
    m = schedule.n_microbatches
    if placement == "front":
        orders = []
        for r, prog in enumerate(schedule.actions):
            mine = [mb for mb in range(m) if preprocess_owner(s2r, mb) == r]
            orders.append([PF(mb) for mb in mine] + list(prog) + [PB(mb) for mb in mine])
        return _marked(schedule, orders)
    if stage_costs is None:
        duration = _unit
    else:
        costs = list(stage_costs)
        if len(costs) != schedule.n_stages:
            raise ScheduleError(f"mpipe: got {len(costs)} stage costs for {schedule.n_stages} stages")

        def duration(a: Action) -> float:
            c = costs[a.stage]
            f, bi = float(c[0]), float(c[1])
            bw = float(c[2]) if len(c) > 2 else 0.0
            return {K.FORWARD: f, K.BACKWARD: bi + bw, K.BACKWARD_INPUT: bi,
                    K.BACKWARD_WEIGHT: bw}.get(a.kind, 0.0)
    if lead is None:
        lead = float(tower_cost[0]) if tower_cost is not None else 0.0
    events = play(lower(schedule), duration)
    start = {(e.action.kind, e.action.stage, e.action.microbatch): e.start for evs in events for e in evs}
    end = {(e.action.kind, e.action.stage, e.action.microbatch): e.end for evs in events for e in evs}
    orders = []
    for r, prog in enumerate(schedule.actions):
        keyed = [((start[(a.kind, a.stage, a.microbatch)], 1, i), a) for i, a in enumerate(prog)]
        for mb in range(m):
            if preprocess_owner(s2r, mb) != r:
                continue
            back = end.get((K.BACKWARD, 0, mb), end.get((K.BACKWARD_INPUT, 0, mb)))
            if back is None:
                raise ScheduleError(f"mpipe: {schedule.name} never runs stage 0's backward of micro-batch {mb}")
            keyed.append(((start[(K.FORWARD, 0, mb)] - lead, 0, mb), PF(mb)))
            keyed.append(((back, 0, m + mb), PB(mb)))
        orders.append([a for _, a in sorted(keyed, key=lambda kv: kv[0])])
    return _marked(schedule, orders)


def _marked(schedule: PipelineSchedule, orders: list[list[Action]]) -> PipelineSchedule:
    out = PipelineSchedule(f"MPipe({schedule.name})", schedule.n_microbatches, schedule.stage_to_rank, orders,
                           schedule.uses_split_backward, dict(schedule.meta))
    out.meta["preprocess"] = True
    out.meta["base"] = schedule.name
    return out
