"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZBV as compute orders.

Each returns a :class:`PipelineSchedule` of compute actions; ``lower`` adds the P2P actions.
They check the micro-batch count up front and name the constraint that fails, because a bad count
discovered at run time would hang a process group instead.
"""
from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.list_scheduler import greedy_schedule
from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    B, F, PipelineSchedule, loop_placement, v_placement,
)
from hyper_parallel.errors import ScheduleError


def _check(name: str, n_ranks: int, n_microbatches: int) -> None:
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise ScheduleError(f"{name}: n_ranks must be a positive int, got {n_ranks!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ScheduleError(f"{name}: n_microbatches must be a positive int, got {n_microbatches!r}")


def gpipe(n_ranks: int, n_microbatches: int) -> PipelineSchedule:
    """All forwards, then all backwards: simplest, holds every micro-batch's activations."""
    _check("GPipe", n_ranks, n_microbatches)
    m = n_microbatches
    orders = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(n_ranks)]
    return PipelineSchedule("GPipe", m, loop_placement(n_ranks, n_ranks), orders)


def one_f_one_b(n_ranks: int, n_microbatches: int) -> PipelineSchedule:
    """Warm up with p-1-r forwards, then alternate one forward and one backward; GPipe's bubble
    with at most p-r micro-batches in flight on rank r."""
    _check("1F1B", n_ranks, n_microbatches)
    p, m = n_ranks, n_microbatches
    orders = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        prog = [F(r, i) for i in range(warm)]
        for i in range(m - warm):
            prog += [F(r, warm + i), B(r, i)]
        prog += [B(r, i) for i in range(m - warm, m)]
        orders.append(prog)
    return PipelineSchedule("1F1B", m, loop_placement(p, p), orders)


def interleaved_1f1b(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> PipelineSchedule:
    """Megatron's interleaved 1F1B: v stages per rank (stage s on rank s % p), micro-batches in
    groups of p, so the bubble shrinks to (p-1)/(v m). Needs m to be a multiple of p."""
    _check("Interleaved1F1B", n_ranks, n_microbatches)
    p, m, v = n_ranks, n_microbatches, n_virtual
    if v < 1:
        raise ScheduleError(f"Interleaved1F1B: n_virtual must be >= 1, got {v}")
    if m % p:
        raise ScheduleError(
            f"Interleaved1F1B: n_microbatches={m} is not a multiple of the {p} pipeline ranks; "
            f"use one of {[k * p for k in range(1, 4)]}")
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (k // (p * v)) * p + k % p

    orders = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        prog = []
        for k in range(warm):
            c, mb = unit(k, True)
            prog.append(F(c * p + r, mb))
        for k in range(total - warm):
            c, mb = unit(warm + k, True)
            prog.append(F(c * p + r, mb))
            c, mb = unit(k, False)
            prog.append(B(c * p + r, mb))
        for k in range(total - warm, total):
            c, mb = unit(k, False)
            prog.append(B(c * p + r, mb))
        orders.append(prog)
    sched = PipelineSchedule("Interleaved1F1B", m, loop_placement(p, p * v), orders)
    sched.meta["n_virtual"] = v
    return sched


def zero_bubble_h1(n_ranks: int, n_microbatches: int) -> PipelineSchedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into dx (I) and dw (W), W deferred
    into the bubbles; same in-flight memory as 1F1B, bubble (p-1)/(3m) when T_F = T_B = T_W."""
    _check("ZeroBubble", n_ranks, n_microbatches)
    p = n_ranks
    sched = greedy_schedule("ZeroBubble", loop_placement(p, p), n_microbatches,
                            [p - r for r in range(p)], split_backward=True)
    return sched


def zbv(n_ranks: int, n_microbatches: int) -> PipelineSchedule:
    """ZBV: two stages per rank in a V (rank r: stages r and 2p-1-r), dx/dw split, the first
    rank also holds the last stage so the loss turns around without a hop."""
    _check("ZBV", n_ranks, n_microbatches)
    p = n_ranks
    sched = greedy_schedule("ZBV", v_placement(p), n_microbatches, [2 * p] * p, split_backward=True,
                           w_cap=[1] * p)
    sched.meta["n_virtual"] = 2
    return sched
