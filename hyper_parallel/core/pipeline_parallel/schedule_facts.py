"""One table of per-schedule facts, owned by the runtime and read by the planner and the cost model.

Why: the schedule names and what follows from them (stages per rank, split dx/dw backward,
activations in flight, bubble) used to be typed by hand in the runtime, the plan runner, the
pipeline and cluster searches, the plan schema and the cost model, and the copies drifted. Here
each schedule is one row: its canonical name (the one plans store), the runtime class that runs
it, and facts *derived from the class's own generator* -- stages per rank from the IR's placement,
split backward from its actions, in-flight micro-batches by playing each rank's program, the
bubble coefficient by simulating a reference pipeline with T_F = T_I = T_W. Nothing is re-typed,
so a change to a generator changes every consumer at once.

    facts = schedule_facts("Interleaved1F1B")
    facts.ir(p, m, v)                    # the generator's compute IR (cached)
    facts.order(p, m, v)                 # the same order as integer codes (orders.ComputeOrder)
    facts.stages_per_rank(v), facts.split_backward
    facts.inflight(p, m, v)              # peak in-flight chunks per pipeline rank
    facts.inflight_microbatches(p, m, rank, v)   # the same in micro-batches of the rank's layers
    facts.bubble_fraction(p, m, v)       # closed form of the simulated bubble (uniform stages)
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from fractions import Fraction

from hyper_parallel.core.pipeline_parallel.orders import ComputeOrder, peak_inflight as order_peak_inflight
from hyper_parallel.core.pipeline_parallel.schedule_ir import ActionKind, PipelineSchedule
from hyper_parallel.core.pipeline_parallel.schedules import (
    PipelineScheduleRuntime, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBV, ScheduleZeroBubble,
)
from hyper_parallel.core.pipeline_parallel.simulator import StageCost, simulate
from hyper_parallel.errors import ScheduleError, UnknownScheduleError

# (p, m, v) of the pipeline whose simulated bubble gives each schedule's coefficient: m a multiple
# of p (Interleaved1F1B needs it) and m > p, where every generator is in its steady state
_REFERENCE = (4, 8, 2)


@dataclass(frozen=True)
class ScheduleFacts:
    """One pipeline schedule: the name plans store, the runtime class that runs it and torch's class
    of the same family. Every other fact is read off the class's generator (module docstring)."""

    name: str
    schedule_class: type[PipelineScheduleRuntime]
    torch_class: str   # the same family in torch.distributed.pipelining (for comparisons with torch)

    # whether the plan chooses the stages per rank (the generator takes ``n_virtual``); read once
    # here because the planner asks on every look-up in its inner loops
    virtual_configurable: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "virtual_configurable",
                           "n_virtual" in inspect.signature(self.schedule_class.generator).parameters)

    @property
    def generator(self):
        return self.schedule_class.generator

    def generator_kwargs(self, v: int = 1) -> dict:
        """Keyword arguments of the generator (and the runtime class) for ``v`` stages per rank."""
        return {"n_virtual": int(v)} if self.virtual_configurable else {}

    def ir(self, p: int, m: int, v: int = 1) -> PipelineSchedule:
        """The generator's compute IR on ``p`` ranks with ``m`` micro-batches (cached: the planner
        asks for the same few IRs many times). ``v`` is ignored where the schedule fixes it."""
        return _ir(self.name, p, m, int(v) if self.virtual_configurable else 1)

    def order(self, p: int, m: int, v: int = 1) -> ComputeOrder:
        """The same order as integer codes (``orders``; cached): what the planner reads."""
        return _order(self.name, p, m, int(v) if self.virtual_configurable else 1)

    def stages_per_rank(self, v: int = 1) -> int:
        """Pipeline stages each rank holds: 1 (GPipe, 1F1B, ZB-H1), ``v`` (interleaved), 2 (ZBV)."""
        return _stages_per_rank(self.name, int(v) if self.virtual_configurable else 1)

    def n_stages(self, p: int, v: int = 1) -> int:
        return p * self.stages_per_rank(v)

    @property
    def split_backward(self) -> bool:
        """Whether the backward runs as dx (I) then dw (W) -- a second backward pass per stage."""
        return _split_backward(self.name)

    def inflight(self, p: int, m: int, v: int = 1) -> tuple[int, ...]:
        """Peak (stage, micro-batch) chunks each pipeline rank holds activations for."""
        return _inflight(self.name, p, m, int(v) if self.virtual_configurable else 1)

    def inflight_microbatches(self, p: int, m: int, rank: int = 0, v: int = 1) -> float:
        """Micro-batches' worth of rank ``rank``'s activations alive at its peak: its peak chunks over
        its stages (a chunk is one stage's share of the rank's layers). With one stage per rank,
        ``rank`` is the stage index."""
        if not isinstance(rank, int) or not 0 <= rank < p:
            raise ScheduleError(f"{self.name}: rank={rank!r} must be a pipeline rank in [0, {p})")
        return self.inflight(p, m, v)[rank] / self.stages_per_rank(v)

    @property
    def bubble_coefficient(self) -> float:
        """c in bubble = c (p-1) / (m v'), v' the configurable stages per rank (else 1): 1 for GPipe
        and 1F1B and interleaved 1F1B, 1/3 for ZB-H1, 1/6 for this runtime's ZBV (formulas.md)."""
        return _bubble_coefficient(self.name)

    def bubble_fraction(self, p: int, m: int, v: int = 1) -> float:
        """Idle over busy time of the busiest rank for uniform stages (simulator's definition), in
        closed form; the simulator gives exactly this whenever m is a multiple of p."""
        vv = int(v) if self.virtual_configurable else 1
        return self.bubble_coefficient * (p - 1) / (m * vv)


SCHEDULES: dict[str, ScheduleFacts] = {f.name: f for f in (
    ScheduleFacts("GPipe", ScheduleGPipe, "ScheduleGPipe"),
    ScheduleFacts("1F1B", Schedule1F1B, "Schedule1F1B"),
    ScheduleFacts("Interleaved1F1B", ScheduleInterleaved1F1B, "ScheduleInterleaved1F1B"),
    ScheduleFacts("ZeroBubble", ScheduleZeroBubble, "ScheduleInterleavedZeroBubble"),   # on one stage per rank
    ScheduleFacts("ZBV", ScheduleZBV, "ScheduleZBVZeroBubble"),
)}
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)


def schedule_facts(name: str, argument: str = "schedule") -> ScheduleFacts:
    """The row of ``name``; an unknown name raises UnknownScheduleError naming ``argument``."""
    facts = SCHEDULES.get(name) if isinstance(name, str) else None
    if facts is None:
        raise UnknownScheduleError(f"{argument}={name!r} is not a pipeline schedule; valid: {list(SCHEDULE_NAMES)}")
    return facts


def build_schedule(name: str, n_ranks: int, n_microbatches: int, **kwargs) -> PipelineSchedule:
    """Generator by name (the names the planner writes into a Plan), uncached."""
    return schedule_facts(name).generator(n_ranks, n_microbatches, **kwargs)


@functools.lru_cache(maxsize=256)
def _ir(name: str, p: int, m: int, v: int) -> PipelineSchedule:
    return _order(name, p, m, v).schedule()


@functools.lru_cache(maxsize=256)
def _order(name: str, p: int, m: int, v: int) -> ComputeOrder:
    facts = schedule_facts(name)
    return facts.generator.order(p, m, **facts.generator_kwargs(v))


@functools.lru_cache(maxsize=None)
def _stages_per_rank(name: str, v: int) -> int:
    return _ir(name, 1, 1, v).n_stages


@functools.lru_cache(maxsize=None)
def _split_backward(name: str) -> bool:
    split = (ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
    return any(a.kind in split for prog in _ir(name, 2, 2, 2).actions for a in prog)


@functools.lru_cache(maxsize=256)
def _inflight(name: str, p: int, m: int, v: int) -> tuple[int, ...]:
    return tuple(order_peak_inflight(_order(name, p, m, v)))


@functools.lru_cache(maxsize=None)
def _bubble_coefficient(name: str) -> float:
    facts = schedule_facts(name)
    p, m, v = _REFERENCE
    vv = v if facts.virtual_configurable else 1
    res = simulate(facts.ir(p, m, vv), StageCost(1, 1, 1), 0.0)
    top = max(res.busy)   # integer-valued: exact Fractions, so 1/3 and 1/6 come out as the floats 1/3, 1/6
    return float(Fraction(int(res.step_time - top), int(top)) * m * vv / (p - 1))
