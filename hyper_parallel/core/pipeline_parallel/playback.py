"""Play a lowered schedule forward in time: the shared engine of the validator and the simulator.

Semantics (what the executor guarantees): each rank runs its actions in order; a send never
blocks (it is posted and waited at the end of the step); a receive blocks until the matching
send has been posted; compute needs its inputs (a receive on this rank, or the neighbouring
stage's compute if that stage lives on the same rank). If no rank can move and some have actions
left, the order deadlocks; the error names every stuck rank, its step and the action.

MPipe (``meta["preprocess"]``): stage 0's forward needs the tower output (PRE_F on this rank or
RECV_PRE), the tower backward (PRE_B) needs its forward and the gradient (stage 0's B/I on this
rank or RECV_PRE_B). REDUCE_PRE is a collective: it starts when every rank has reached it and
lasts ``duration(REDUCE_PRE)``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    RECV_KINDS, SEND_KINDS, Action, ActionKind, PipelineSchedule, matching, peer_of, preprocess_owner,
)
from hyper_parallel.errors import ScheduleError

K = ActionKind


@dataclass
class Event:
    rank: int
    step: int
    action: Action
    start: float
    end: float


def _needs(action: Action, s2r, rank: int, last: int, pre: bool = False) -> list[Action]:
    """Actions that must have run before ``action`` on this rank (local dependencies)."""
    s, mb = action.stage, action.microbatch
    if action.kind in (K.PRE_F, K.REDUCE_PRE):
        return []
    if action.kind is K.PRE_B:
        local = preprocess_owner(s2r, mb) == s2r[0]
        return [Action(K.PRE_F, 0, mb), Action("grad", 0, mb) if local else Action(K.RECV_PRE_B, 0, mb)]
    if action.kind is K.SEND_PRE:
        return [Action(K.PRE_F, 0, mb)]
    if action.kind is K.SEND_PRE_B:
        return [Action("grad", 0, mb)]
    if action.kind is K.FORWARD:
        if s == 0:
            if not pre:
                return []
            return [Action(K.PRE_F, 0, mb) if preprocess_owner(s2r, mb) == rank else Action(K.RECV_PRE, 0, mb)]
        return [Action(K.FORWARD, s - 1, mb) if s2r[s - 1] == rank else Action(K.RECV_F, s, mb)]
    if action.kind in (K.BACKWARD, K.BACKWARD_INPUT):
        deps = [Action(K.FORWARD, s, mb)]
        if s < last:
            deps.append(Action("grad", s + 1, mb) if s2r[s + 1] == rank else Action(K.RECV_B, s, mb))
        return deps
    if action.kind is K.BACKWARD_WEIGHT:
        return [Action(K.BACKWARD_INPUT, s, mb)]
    if action.kind is K.SEND_F:
        return [Action(K.FORWARD, s, mb)]
    if action.kind is K.SEND_B:
        return [Action("grad", s, mb)]
    return []


def play(schedule: PipelineSchedule, duration: Callable[[Action], float] | None = None,
         p2p_time: float = 0.0) -> list[list[Event]]:
    """Timed events per rank. Raises ScheduleError on a missing dependency or a deadlock."""
    s2r, last = schedule.stage_to_rank, schedule.n_stages - 1
    pre = bool(schedule.meta.get("preprocess"))
    duration = duration or (lambda a: 0.0)
    progs = schedule.actions
    n = len(progs)
    ptr = [0] * n
    clock = [0.0] * n
    done: list[dict] = [dict() for _ in range(n)]   # rank -> {action or ("grad", s, mb): end time}
    posted: dict[Action, float] = {}                  # send action -> arrival time at the peer
    events: list[list[Event]] = [[] for _ in range(n)]
    # where each local dependency appears, to tell "later on this rank" from "never"
    index = [{a: i for i, a in enumerate(prog)} for prog in progs]
    reducers = {r for r, prog in enumerate(progs) if any(a.kind is K.REDUCE_PRE for a in prog)}
    arrived: dict[int, float] = {}                    # rank -> when it reached REDUCE_PRE

    def satisfied(rank: int, dep: Action):
        if dep.kind == "grad":
            for kind in (K.BACKWARD, K.BACKWARD_INPUT):
                a = Action(kind, dep.stage, dep.microbatch)
                if a in done[rank]:
                    return done[rank][a]
            return None
        return done[rank].get(dep)

    def missing(rank: int, step: int, action: Action, dep: Action) -> ScheduleError:
        if dep.kind == "grad":
            where = [index[rank].get(Action(k, dep.stage, dep.microbatch)) for k in (K.BACKWARD, K.BACKWARD_INPUT)]
            later = any(w is not None and w > step for w in where)
            what = f"the input-gradient of stage {dep.stage} micro-batch {dep.microbatch}"
        else:
            later = index[rank].get(dep, -1) > step
            what = str(dep)
        return ScheduleError(
            f"{schedule.name}: rank {rank} step {step}: {action} needs {what} "
            + ("which comes later on the same rank" if later else "which rank {} never runs".format(rank)))

    remaining = sum(len(p) for p in progs)
    while remaining:
        moved = False
        for r in range(n):
            while ptr[r] < len(progs[r]):
                step, a = ptr[r], progs[r][ptr[r]]
                ready = clock[r]
                blocked = False
                for dep in _needs(a, s2r, r, last, pre):
                    t = satisfied(r, dep)
                    if t is None:
                        raise missing(r, step, a, dep)
                    ready = max(ready, t)
                if a.kind in RECV_KINDS:
                    send = matching(a)
                    if send not in posted:
                        blocked = True
                    else:
                        start, end = clock[r], max(clock[r], posted[send])
                elif a.kind is K.REDUCE_PRE:
                    arrived.setdefault(r, ready)
                    if len(arrived) < len(reducers):
                        blocked = True
                    else:
                        start = max(arrived.values())
                        end = start + duration(a)
                if blocked:
                    break
                if a.kind not in RECV_KINDS and a.kind is not K.REDUCE_PRE:
                    start = ready
                    end = start + (duration(a) if a.is_compute else 0.0)
                if a.kind in SEND_KINDS:
                    posted[a] = end + p2p_time
                done[r][a] = end
                clock[r] = end
                events[r].append(Event(r, step, a, start, end))
                ptr[r] += 1
                remaining -= 1
                moved = True
        if not moved and remaining:
            stuck = [f"rank {r} step {ptr[r]}: {progs[r][ptr[r]]} waits for " + (
                     "every rank to reach REDUCE_PRE" if progs[r][ptr[r]].kind is K.REDUCE_PRE else
                     f"{matching(progs[r][ptr[r]])} from rank {peer_of(progs[r][ptr[r]], s2r)}")
                     for r in range(n) if ptr[r] < len(progs[r])]
            raise ScheduleError(f"{schedule.name}: deadlock, no rank can proceed: " + "; ".join(stuck))
    return events
