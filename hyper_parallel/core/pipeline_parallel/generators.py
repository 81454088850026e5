"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZBV as compute orders.

Each returns a :class:`PipelineSchedule` of compute actions; ``lower`` adds the P2P actions.
Each is built from an integer order (``orders.ComputeOrder``): ``generator.order(...)`` gives it
without Action objects, for the planner.
They check the micro-batch count up front and name the constraint that fails, because a bad count
discovered at run time would hang a process group instead.
"""
from __future__ import annotations

from hyper_parallel.core.pipeline_parallel.list_scheduler import greedy_order
from hyper_parallel.core.pipeline_parallel.orders import (
    ComputeOrder, as_arrays, gpipe_order as _gpipe, interleaved_order as _interleaved, one_f_one_b_order as _1f1b,
)
from hyper_parallel.core.pipeline_parallel.schedule_ir import PipelineSchedule, loop_placement, v_placement
from hyper_parallel.errors import ScheduleError


def _check(name: str, n_ranks: int, n_microbatches: int) -> None:
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise ScheduleError(f"{name}: n_ranks must be a positive int, got {n_ranks!r}")
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ScheduleError(f"{name}: n_microbatches must be a positive int, got {n_microbatches!r}")


def _with_order(build):
    """A generator of PipelineSchedules from ``build``, a builder of integer orders (kept as the
    generator's ``order``: the planner reads orders, the runtime the decoded IR)."""
    def generator(*args, **kwargs) -> PipelineSchedule:
        return build(*args, **kwargs).schedule()
    generator.__name__, generator.__qualname__ = build.__name__, build.__qualname__
    generator.__doc__, generator.__module__ = build.__doc__, build.__module__
    generator.__wrapped__ = build   # inspect.signature reads the builder's parameters
    generator.order = build
    return generator


@_with_order
def gpipe(n_ranks: int, n_microbatches: int) -> ComputeOrder:
    """All forwards, then all backwards: simplest, holds every micro-batch's activations."""
    _check("GPipe", n_ranks, n_microbatches)
    return ComputeOrder("GPipe", n_microbatches, loop_placement(n_ranks, n_ranks),
                        as_arrays(_gpipe(n_ranks, n_microbatches)))


@_with_order
def one_f_one_b(n_ranks: int, n_microbatches: int) -> ComputeOrder:
    """Warm up with p-1-r forwards, then alternate one forward and one backward; GPipe's bubble
    with at most p-r micro-batches in flight on rank r."""
    _check("1F1B", n_ranks, n_microbatches)
    return ComputeOrder("1F1B", n_microbatches, loop_placement(n_ranks, n_ranks),
                        as_arrays(_1f1b(n_ranks, n_microbatches)))


@_with_order
def interleaved_1f1b(n_ranks: int, n_microbatches: int, n_virtual: int = 2) -> ComputeOrder:
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
    return ComputeOrder("Interleaved1F1B", m, loop_placement(p, p * v), as_arrays(_interleaved(p, m, v)),
                        n_virtual=v)


@_with_order
def zero_bubble_h1(n_ranks: int, n_microbatches: int) -> ComputeOrder:
    """ZB-H1 (Qi et al. 2023): 1F1B with the backward split into dx (I) and dw (W), W deferred
    into the bubbles; same in-flight memory as 1F1B, bubble (p-1)/(3m) when T_F = T_B = T_W."""
    _check("ZeroBubble", n_ranks, n_microbatches)
    p = n_ranks
    return greedy_order("ZeroBubble", loop_placement(p, p), n_microbatches, [p - r for r in range(p)],
                        split_backward=True)


@_with_order
def zbv(n_ranks: int, n_microbatches: int) -> ComputeOrder:
    """ZBV: two stages per rank in a V (rank r: stages r and 2p-1-r), dx/dw split, the first
    rank also holds the last stage so the loss turns around without a hop."""
    _check("ZBV", n_ranks, n_microbatches)
    p = n_ranks
    return greedy_order("ZBV", v_placement(p), n_microbatches, [2 * p] * p, split_backward=True,
                        w_cap=[1] * p, n_virtual=2)
