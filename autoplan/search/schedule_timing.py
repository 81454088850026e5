"""The simulator's timing of a schedule IR, compiled once per (schedule, p, m, v).

Why: the planner times hundreds of cost vectors on the same few schedule IRs. ``playback.play``
re-derives every dependency with Action objects and dict look-ups on each call (~0.1 s at p=16,
m=128). The order in which ``play`` can process actions, and what each action waits for, do not
depend on the durations, so they are derived here once with the same rules (``playback._needs``,
receives wait for the matching send) and each timing is a flat loop over integer arrays. It
returns exactly what ``play`` gives (tests/search_pp compare them on random costs).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hyper_parallel.core.pipeline_parallel import lower, schedule_facts
from hyper_parallel.core.pipeline_parallel.playback import _needs
from hyper_parallel.core.pipeline_parallel.schedule_ir import ActionKind as K, matching
from hyper_parallel.errors import ScheduleError

# duration slots per action: forward, full backward, backward-input, backward-weight, none
_F, _B, _I, _W, _NONE = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class CompiledSchedule:
    n_ranks: int
    order: tuple[int, ...]          # global processing order (action ids)
    rank: tuple[int, ...]
    stage: tuple[int, ...]
    slot: tuple[int, ...]           # _F/_B/_I/_W/_NONE
    deps: tuple[tuple[int, ...], ...]
    recv_of: tuple[int, ...]        # for a receive: the id of its send, else -1
    is_send: tuple[bool, ...]
    stage_to_rank: tuple[int, ...]


# ------------------------------------------------------------------ lowered IR (cached)

@functools.lru_cache(maxsize=64)
def lowered_schedule(name: str, p: int, m: int, v: int = 1):
    """The lowered IR of a schedule (compute plus send/recv actions, what the executor runs).

    ``simulate`` runs the full validator on every call (quadratic membership checks: ~1.4 s at
    p=16, m=128); the generators' output is validated by the runtime before it runs and by
    tests/pipeline, and the timing itself raises on a deadlock, so the planner lowers only."""
    return lower(schedule_facts(name).ir(p, m, v))


@functools.lru_cache(maxsize=256)
def compile_schedule(name: str, p: int, m: int, v: int = 1) -> CompiledSchedule:
    """Action ids, what each waits for and one processing order. Dependencies inside a rank are
    earlier actions of its own program (``_needs``; one that has not run is an error in the
    schedule), so the only wait across ranks is a receive for its send: each rank runs until a
    receive whose send has not run, and a send wakes the rank parked on its receive. Any such
    order times the same (a rank's clock and every end time are fixed by the dependencies), and
    this one visits each action once (the previous round-robin rescanned every parked rank per
    round: 0.8 s per compile at p=64, m=240)."""
    lowered = lowered_schedule(name, p, m, v)
    s2r, last = lowered.stage_to_rank, lowered.n_stages - 1
    progs = lowered.actions
    rank, stage, slot, is_send = [], [], [], []
    kinds = {K.FORWARD: _F, K.BACKWARD: _B, K.BACKWARD_INPUT: _I, K.BACKWARD_WEIGHT: _W}
    local_id: list[dict] = []
    for r, prog in enumerate(progs):
        ids_r = {}
        for a in prog:
            ids_r[a] = len(rank)
            rank.append(r)
            stage.append(a.stage)
            slot.append(kinds.get(a.kind, _NONE))
            is_send.append(a.kind in (K.SEND_F, K.SEND_B))
        local_id.append(ids_r)
    n = len(rank)
    deps: list[tuple[int, ...]] = [()] * n
    recv_of = [-1] * n
    send_id = {a: local_id[r][a] for r, prog in enumerate(progs) for a in prog if a.kind in (K.SEND_F, K.SEND_B)}
    done = bytearray(n)
    order: list[int] = []
    ptr = [0] * len(progs)
    parked: dict[int, int] = {}         # send id -> the rank whose next action receives it
    ready = list(range(len(progs)))
    grad_kinds = (K.BACKWARD, K.BACKWARD_INPUT)
    while ready:
        r = ready.pop()
        prog, ids_r = progs[r], local_id[r]
        while ptr[r] < len(prog):
            a = prog[ptr[r]]
            i = ids_r[a]
            if a.kind in (K.RECV_F, K.RECV_B):
                s_id = send_id.get(matching(a))
                if s_id is None:
                    raise ScheduleError(f"{name}: rank {r} step {ptr[r]}: {a} has no matching send")
                if not done[s_id]:
                    parked[s_id] = r
                    break
                recv_of[i] = s_id
            dl = []
            for dep in _needs(a, s2r, r, last):
                if dep.kind == "grad":
                    got = [c for c in (ids_r.get(type(a)(k, dep.stage, dep.microbatch)) for k in grad_kinds)
                           if c is not None and done[c]]
                else:
                    c = ids_r.get(dep)
                    got = [c] if c is not None and done[c] else []
                if not got:
                    raise ScheduleError(f"{name}: rank {r} step {ptr[r]}: {a} needs {dep} first")
                dl.append(got[0])
            deps[i] = tuple(dl)
            done[i] = 1
            order.append(i)
            ptr[r] += 1
            waiting = parked.pop(i, None)
            if waiting is not None:
                ready.append(waiting)
    if len(order) < n:
        raise ScheduleError(f"{name}: the order deadlocks (p={p}, m={m})")
    return CompiledSchedule(len(progs), tuple(order), tuple(rank), tuple(stage), tuple(slot), tuple(deps),
                            tuple(recv_of), tuple(is_send), tuple(s2r))


def time_schedule(cs: CompiledSchedule, costs, p2p_time: float) -> tuple[float, list[float]]:
    """(step time, busy seconds per rank) of ``costs`` (one StageCost per stage) on ``cs``."""
    table = [(c.forward, c.backward_input + c.backward_weight, c.backward_input, c.backward_weight, 0.0)
             for c in costs]
    n = len(cs.rank)
    end = [0.0] * n
    clock = [0.0] * cs.n_ranks
    busy = [0.0] * cs.n_ranks
    rank, stage, slot, deps, recv_of = cs.rank, cs.stage, cs.slot, cs.deps, cs.recv_of
    for i in cs.order:
        r = rank[i]
        s = recv_of[i]
        if s >= 0:
            t = end[s] + p2p_time
            e = t if t > clock[r] else clock[r]
        else:
            ready = clock[r]
            for d in deps[i]:
                if end[d] > ready:
                    ready = end[d]
            dur = table[stage[i]][slot[i]]
            e = ready + dur
            busy[r] += dur
        end[i] = e
        clock[r] = e
    # a send's "end" is when it was posted; its arrival adds p2p_time (applied at the receive)
    step = max(clock) if clock else 0.0
    return step, busy
