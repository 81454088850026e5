"""Greedy list scheduling of pipeline compute, used to derive the zero-bubble orders.

Zero-bubble schedules fill the pipeline's idle slots with deferred weight-gradient (W) work;
rather than hand-coding each rank's order we play the pipeline forward in unit time steps and let
every idle rank pick the most urgent ready action: dx (I/B) first (it is on the critical path),
then a forward if the rank's in-flight limit allows, then a deferred W. With T_F = T_B = T_W this
reproduces ZB-H1 (bubble (p-1)/(3m)) under the 1F1B memory limit. The result is only an order;
it carries no times.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from hyper_parallel.core.pipeline_parallel.orders import ComputeOrder
from hyper_parallel.core.pipeline_parallel.schedule_ir import PipelineSchedule
from hyper_parallel.errors import ScheduleError


def greedy_schedule(name: str, stage_to_rank: Sequence[int], n_microbatches: int,
                    inflight_limit: Sequence[int], split_backward: bool = True,
                    cost: tuple[int, int, int] = (1, 1, 1),
                    w_cap: Sequence[int] | None = None) -> PipelineSchedule:
    """The runtime's IR of :func:`greedy_order`."""
    return greedy_order(name, stage_to_rank, n_microbatches, inflight_limit, split_backward, cost,
                        w_cap).schedule()


def greedy_order(name: str, stage_to_rank: Sequence[int], n_microbatches: int,
                 inflight_limit: Sequence[int], split_backward: bool = True,
                 cost: tuple[int, int, int] = (1, 1, 1),
                 w_cap: Sequence[int] | None = None, n_virtual: int | None = None) -> ComputeOrder:
    """Compute order per rank from a unit-time greedy play of the pipeline, as integer codes
    (``orders``; no Action objects: the planner builds orders at p=128, m=2048).

    ``inflight_limit[r]`` bounds, on rank r, the micro-batch chunks whose forward ran and whose
    input gradient (I or B) has not yet: the activation memory the schedule may hold.
    ``cost`` = (T_F, T_I, T_W) in time units; a full B costs T_I + T_W. ``w_cap[r]``, when given,
    makes rank r run a deferred W before any new forward once that many W are pending (bounds
    the memory that W's saved inputs hold, at some cost in bubble).

    The play is exact and steps every time unit, with three shortcuts that change nothing it
    decides (tests/pipeline/test_schedule_orders.py compares it with the plain play):

    - a rank's pending W's are a count: they run first in, first out, so its j-th W is the dx of
      its j-th I, filled in at the end;
    - a rank whose every I has run has only its pending W's left, one per step: they are written
      at once (no other rank reads a W);
    - with unit times every action started before step t has ended at t, so the state a step
      starts from is (next forward and next dx per stage, in flight and pending W's per rank):
      when it recurs shifted by d micro-batches, the steps between repeat shifted by d for as
      long as every micro-batch they would touch exists, and are copied instead of played.
    """
    n_stages, m = len(stage_to_rank), n_microbatches
    n_ranks = max(stage_to_rank) + 1
    tf, ti, tw = cost
    never = 1 << 60
    # end times per stage and micro-batch, flat (index s * m + mb); one extra stage past the
    # last whose dx has always ended, so the dx test of the last stage needs no branch
    f_end = [never] * (n_stages * m)
    b_end = [never] * ((n_stages + 1) * m)
    b_end[n_stages * m:] = [0] * m
    next_f = [0] * n_stages
    next_b = [0] * n_stages
    pending = [0] * n_ranks           # W's whose I ran on the rank and that have not run
    inflight = [0] * n_ranks
    free_at = [0] * n_ranks
    orders: list[list[int]] = [[] for _ in range(n_ranks)]
    deepest_first = [tuple(sorted((s for s in range(n_stages) if stage_to_rank[s] == r), reverse=True))
                     for r in range(n_ranks)]
    dx_left = [len(st) * m for st in deepest_first]
    back_slot = 2 if split_backward else 1
    b_dur = ti if split_backward else ti + tw
    total = n_stages * m * (3 if split_backward else 2)
    caps = list(w_cap) if w_cap is not None else None
    limits = list(inflight_limit)
    ranks = range(n_ranks)
    done, t, idle_steps = 0, 0, 0
    unit = split_backward and tf == ti == tw == 1   # the shortcuts' setting (docstring)
    periodic = unit
    seen: dict[tuple, tuple] = {}
    while done < total:
        if periodic and next_f[0] >= m - 1:
            periodic = False   # no whole period fits any more (stage 0 leads every forward)
        if periodic:
            jump = _recurrence(seen, t, m, next_f, next_b, inflight, pending, idle_steps, orders, caps is None)
            if jump is not None:
                k, d, period, added = jump
                for st in range(n_stages):
                    for arr, nxt in ((f_end, next_f), (b_end, next_b)):
                        arr[st * m + nxt[st]:st * m + nxt[st] + k * d] = [t] * (k * d)
                    next_f[st] += k * d
                    next_b[st] += k * d
                for r in ranks:
                    pending[r] += k * added[r][0]
                    dx_left[r] -= k * added[r][1]
                    done += k * added[r][2]
                t += k * period
                periodic = False
        progressed = False
        for r in ranks:
            if free_at[r] > t:
                continue
            order = orders[r]
            # 1) input-gradient work, deepest stage first (closest to finishing a micro-batch)
            for s in deepest_first[r]:
                mb = next_b[s]
                if mb < m:
                    k = s * m + mb
                    if f_end[k] <= t and b_end[k + m] <= t:
                        free_at[r] = b_end[k] = t + b_dur
                        next_b[s] = mb + 1
                        inflight[r] -= 1
                        order.append(k * 4 + back_slot)
                        dx_left[r] -= 1
                        if split_backward:
                            pending[r] += 1
                            if unit and not dx_left[r]:   # only its W's are left: written now
                                order += [-1] * pending[r]
                                done += pending[r]
                                pending[r] = 0
                                free_at[r] = never
                        break
            else:
                if caps is not None and pending[r] >= caps[r]:
                    order.append(-1)
                    pending[r] -= 1
                    free_at[r] = t + tw
                else:
                    # 2) a forward, deepest stage first, within the in-flight limit
                    for s in (deepest_first[r] if inflight[r] < limits[r] else ()):
                        mb = next_f[s]
                        if mb < m:
                            k = s * m + mb
                            if s == 0 or f_end[k - m] <= t:
                                free_at[r] = f_end[k] = t + tf
                                next_f[s] = mb + 1
                                inflight[r] += 1
                                order.append(k * 4)
                                break
                    else:
                        # 3) deferred weight gradients fill what is left
                        if not pending[r]:
                            continue
                        order.append(-1)
                        pending[r] -= 1
                        free_at[r] = t + tw
            done += 1
            progressed = True
        idle_steps = 0 if progressed else idle_steps + 1
        if idle_steps > 4 * (tf + ti + tw) * n_stages + 8:
            stuck = {r: inflight[r] for r in range(n_ranks)}
            raise ScheduleError(
                f"{name}: no rank can make progress with in-flight limits {list(inflight_limit)} "
                f"(in flight now {stuck}); raise the limit or the micro-batch count")
        t += 1
    return ComputeOrder(name, m, tuple(stage_to_rank), tuple(_fill_w(o) for o in orders), split_backward, n_virtual)


def _fill_w(order: list[int]) -> np.ndarray:
    """The rank's order with each W (-1) named: its j-th W is the dx of its j-th I."""
    arr = np.asarray(order, dtype=np.int64)
    w = arr == -1
    if w.any():
        arr[w] = arr[(arr & 3) == 2][:int(w.sum())] + 1
    return arr


def _recurrence(seen: dict, t: int, m: int, next_f: list[int], next_b: list[int], inflight: list[int],
                pending: list[int], idle_steps: int, orders: list[list[int]], uncapped: bool):
    """At the start of step t of a unit-time play: (k, d, period, per-rank (pending, dx, actions)
    added per period) when the state recurs shifted by d micro-batches and k more periods fit
    before a micro-batch past the last would be touched, after appending those k periods' actions
    to ``orders`` (shifted by d each; W's stay -1); else None (the state is remembered).

    Without a W cap a rank's pending count matters only when it reaches zero and the rank has
    nothing else to run, which pops a W; so it enters the state as (is it zero) and a recurrence
    whose pending count grew is taken only for ranks that popped no W in between."""
    base = next_f[0]
    key = (tuple(x - base for x in next_f), tuple(x - base for x in next_b), tuple(inflight),
           tuple(min(x, 1) for x in pending) if uncapped else tuple(pending), idle_steps)
    prev = seen.get(key)
    seen[key] = (t, base, tuple(len(o) for o in orders), tuple(pending))
    if prev is None:
        return None
    t0, base0, lens0, pend0 = prev
    d, period = base - base0, t - t0
    top = max(next_f)
    if d <= 0 or top >= m:
        return None
    k = (m - 1 - top) // d
    if k < 1:
        return None
    windows = []
    for r, o in enumerate(orders):
        win = np.asarray(o[lens0[r]:], dtype=np.int64)
        pops = int((win == -1).sum())
        if pending[r] != pend0[r] and pops:
            return None
        windows.append(win)
    added = []
    for r, win in enumerate(windows):
        n_dx = int(((win & 3) == 2).sum())
        added.append((pending[r] - pend0[r], n_dx, len(win)))
        if len(win):
            shift = np.where(win >= 0, 4 * d, 0)
            reps = np.tile(win, k) + np.repeat(np.arange(1, k + 1, dtype=np.int64), len(win)) * np.tile(shift, k)
            orders[r] += reps.tolist()
    return k, d, period, added
