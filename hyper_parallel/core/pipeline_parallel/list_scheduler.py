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

from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    Action, B, F, I, W, PipelineSchedule,
)
from hyper_parallel.errors import ScheduleError


def greedy_schedule(name: str, stage_to_rank: Sequence[int], n_microbatches: int,
                    inflight_limit: Sequence[int], split_backward: bool = True,
                    cost: tuple[int, int, int] = (1, 1, 1),
                    w_cap: Sequence[int] | None = None) -> PipelineSchedule:
    """Compute order per rank from a unit-time greedy play of the pipeline.

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
    # end times per stage and micro-batch (lists, not dicts keyed by tuples: this loop runs
    # hundreds of thousands of times when the planner builds schedules for large m)
    f_end = [[never] * m for _ in range(n_stages)]
    b_end = [[never] * m for _ in range(n_stages)]   # I (or B) end time
    next_f = [0] * n_stages
    next_b = [0] * n_stages
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(n_ranks)]
    inflight = [0] * n_ranks
    free_at = [0] * n_ranks
    orders: list[list[Action]] = [[] for _ in range(n_ranks)]
    deepest_first = [sorted((s for s in range(n_stages) if stage_to_rank[s] == r), reverse=True)
                     for r in range(n_ranks)]
    last = n_stages - 1
    backward = I if split_backward else B
    b_dur = ti if split_backward else ti + tw
    total = n_stages * m * (3 if split_backward else 2)
    done, t, idle_steps = 0, 0, 0
    while done < total:
        progressed = False
        for r in range(n_ranks):
            if free_at[r] > t:
                continue
            # 1) input-gradient work, deepest stage first (closest to finishing a micro-batch)
            for s in deepest_first[r]:
                mb = next_b[s]
                if mb < m and f_end[s][mb] <= t and (s == last or b_end[s + 1][mb] <= t):
                    free_at[r] = b_end[s][mb] = t + b_dur
                    next_b[s] += 1
                    inflight[r] -= 1
                    if split_backward:
                        pending_w[r].append((s, mb))
                    orders[r].append(backward(s, mb))
                    break
            else:
                if w_cap is not None and len(pending_w[r]) >= w_cap[r]:
                    orders[r].append(W(*pending_w[r].popleft()))
                    free_at[r] = t + tw
                else:
                    # 2) a forward, deepest stage first, within the in-flight limit
                    for s in (deepest_first[r] if inflight[r] < inflight_limit[r] else ()):
                        mb = next_f[s]
                        if mb < m and (s == 0 or f_end[s - 1][mb] <= t):
                            free_at[r] = f_end[s][mb] = t + tf
                            next_f[s] += 1
                            inflight[r] += 1
                            orders[r].append(F(s, mb))
                            break
                    else:
                        # 3) deferred weight gradients fill what is left
                        if not pending_w[r]:
                            continue
                        orders[r].append(W(*pending_w[r].popleft()))
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
    return PipelineSchedule(name, m, tuple(stage_to_rank), orders, split_backward)
