"""Greedy list scheduling of pipeline compute, used to derive the zero-bubble orders.

Zero-bubble schedules fill the pipeline's idle slots with deferred weight-gradient (W) work;
rather than hand-coding each rank's order we play the pipeline forward in unit time steps and let
every idle rank pick the most urgent ready action: dx (I/B) first (it is on the critical path),
then a forward if the rank's in-flight limit allows, then a deferred W. With T_F = T_B = T_W this
reproduces ZB-H1 (bubble (p-1)/(3m)) under the 1F1B memory limit. The result is only an order;
it carries no times.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from hyper_parallel.core.pipeline_parallel.orders import ComputeOrder, as_arrays
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
    (``orders``: one loop step per rank and time unit, no Action objects -- this loop runs
    millions of times when the planner builds orders at p=128, m=2048).

    ``inflight_limit[r]`` bounds, on rank r, the micro-batch chunks whose forward ran and whose
    input gradient (I or B) has not yet: the activation memory the schedule may hold.
    ``cost`` = (T_F, T_I, T_W) in time units; a full B costs T_I + T_W. ``w_cap[r]``, when given,
    makes rank r run a deferred W before any new forward once that many W are pending (bounds
    the memory that W's saved inputs hold, at some cost in bubble).
    """
    n_stages, m = len(stage_to_rank), n_microbatches
    n_ranks = max(stage_to_rank) + 1
    tf, ti, tw = cost
    never = 1 << 60
    # end times per stage and micro-batch, flat (index s * m + mb); one extra stage of "never"
    # past the last, so the dx test of the last stage needs no branch
    f_end = [never] * (n_stages * m)
    b_end = [never] * ((n_stages + 1) * m)
    b_end[n_stages * m:] = [0] * m
    next_f = [0] * n_stages
    next_b = [0] * n_stages
    pending_w: list[deque[int]] = [deque() for _ in range(n_ranks)]
    inflight = [0] * n_ranks
    free_at = [0] * n_ranks
    orders: list[list[int]] = [[] for _ in range(n_ranks)]
    deepest_first = [tuple(sorted((s for s in range(n_stages) if stage_to_rank[s] == r), reverse=True))
                     for r in range(n_ranks)]
    back_slot = 2 if split_backward else 1
    b_dur = ti if split_backward else ti + tw
    total = n_stages * m * (3 if split_backward else 2)
    caps = list(w_cap) if w_cap is not None else None
    limits = list(inflight_limit)
    ranks = range(n_ranks)
    done, t, idle_steps = 0, 0, 0
    while done < total:
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
                        if split_backward:
                            pending_w[r].append(k * 4 + 3)
                        order.append(k * 4 + back_slot)
                        break
            else:
                pend = pending_w[r]
                if caps is not None and len(pend) >= caps[r]:
                    order.append(pend.popleft())
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
                        if not pend:
                            continue
                        order.append(pend.popleft())
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
    return ComputeOrder(name, m, tuple(stage_to_rank), as_arrays(orders), split_backward, n_virtual)
