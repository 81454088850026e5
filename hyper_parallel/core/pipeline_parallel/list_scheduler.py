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

from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    Action, ActionKind, B, F, I, W, PipelineSchedule,
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
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}   # I (or B) end time
    next_f = [0] * n_stages
    next_b = [0] * n_stages
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(n_ranks)]
    inflight = [0] * n_ranks
    free_at = [0] * n_ranks
    orders: list[list[Action]] = [[] for _ in range(n_ranks)]
    stages = [[s for s in range(n_stages) if stage_to_rank[s] == r] for r in range(n_ranks)]
    total = n_stages * m * (3 if split_backward else 2)
    done, t, idle_steps = 0, 0, 0
    while done < total:
        progressed = False
        for r in range(n_ranks):
            if free_at[r] > t:
                continue
            choice = None
            # 1) input-gradient work, deepest stage first (closest to finishing a micro-batch)
            for s in sorted(stages[r], reverse=True):
                mb = next_b[s]
                if mb < m and f_end.get((s, mb), 1 << 60) <= t and (
                        s == n_stages - 1 or b_end.get((s + 1, mb), 1 << 60) <= t):
                    choice = (I if split_backward else B)(s, mb)
                    break
            if choice is None and w_cap is not None and len(pending_w[r]) >= w_cap[r]:
                choice = W(*pending_w[r].pop(0))
            # 2) a forward, deepest stage first, within the in-flight limit
            if choice is None and inflight[r] < inflight_limit[r]:
                for s in sorted(stages[r], reverse=True):
                    mb = next_f[s]
                    if mb < m and (s == 0 or f_end.get((s - 1, mb), 1 << 60) <= t):
                        choice = F(s, mb)
                        break
            # 3) deferred weight gradients fill what is left
            if choice is None and pending_w[r]:
                choice = W(*pending_w[r].pop(0))
            if choice is None:
                continue
            s, mb = choice.stage, choice.microbatch
            if choice.kind is ActionKind.FORWARD:
                free_at[r] = f_end[(s, mb)] = t + tf
                next_f[s] += 1
                inflight[r] += 1
            elif choice.kind is ActionKind.BACKWARD_WEIGHT:
                free_at[r] = t + tw
            else:
                dur = ti if split_backward else ti + tw
                free_at[r] = b_end[(s, mb)] = t + dur
                next_b[s] += 1
                inflight[r] -= 1
                if split_backward:
                    pending_w[r].append((s, mb))
            orders[r].append(choice)
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
