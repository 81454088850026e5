"""What the pipeline search reads from a schedule's order, per (schedule, p, m, v), in memory and
on disk (``autoplan.disk_cache``).

Why: the search prices every (schedule, ranks, micro-batches) a mesh allows; each needs its
stage-to-rank map, every rank's peak in-flight chunks (memory), where each rank's work starts and
ends (the lower bound) and how often FSDP gathers each stage's blocks. These come from the
generator's order -- at p=128, m=2048 hundreds of thousands of actions from a greedy list
scheduler, seconds per schedule and most of a cold 405B plan -- yet they are a few
integers per rank and depend on nothing but (schedule, p, m, v) and the generator code. So they
are derived once and kept on disk under the hash of that code; the order itself is generated
only on a miss.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from autoplan import disk_cache
from hyper_parallel.core.pipeline_parallel import generators, schedule_facts
from hyper_parallel.core.pipeline_parallel.orders import SLOT_F, SLOT_W, ComputeOrder, peak_inflight

# the generators, their integer orders, the greedy list scheduler, the IR and the schedule table,
# and this module
GENERATOR_CODE = tuple(str(Path(generators.__file__).with_name(f)) for f in
              ("generators.py", "orders.py", "list_scheduler.py", "schedule_ir.py", "schedule_facts.py")) \
    + (__file__,)


def code_version() -> str:
    """The version every schedule entry on disk is kept under (generators + this module)."""
    return disk_cache.code_version(*GENERATOR_CODE)


def _placement(order: ComputeOrder) -> list:
    return [list(order.stage_to_rank), peak_inflight(order)]


def _rank_ends(order: ComputeOrder) -> list:
    out = []
    for r in range(order.n_ranks):
        slots, stages = order.slots(r), order.stages(r)
        out.append([int(stages[0]), [bool(slots[-1] in (1, 2)), int(stages[-1])],
                    [s for s, rr in enumerate(order.stage_to_rank) if rr == r]])
    return out


def _gathers(order: ComputeOrder) -> list:
    """As the runtime runs FSDP inside a pipeline (fsdp_actions.py): resharded after every
    forward, kept unsharded after backward until the step ends; a forward or backward that finds
    it resharded gathers it (the first of a stage on its rank, or one after a forward)."""
    out = np.zeros(order.n_stages, dtype=np.int64)
    for r in range(order.n_ranks):
        slots, stages = order.slots(r), order.stages(r)
        keep = slots != SLOT_W
        st, fwd = stages[keep], slots[keep] == SLOT_F
        by_stage = np.argsort(st, kind="stable")
        st, fwd = st[by_stage], fwd[by_stage]
        first = np.ones(len(st), dtype=bool)
        first[1:] = st[1:] != st[:-1]
        after_fwd = np.zeros(len(st), dtype=bool)
        after_fwd[1:] = fwd[:-1]
        out += np.bincount(st[first | after_fwd], minlength=order.n_stages)
    return [int(x) for x in out]


_DERIVE = {"placement": _placement, "rank_ends": _rank_ends, "gathers": _gathers}


def normalised_v(name: str, v: int) -> int:
    """``v`` as the schedule table reads it (ignored where the schedule fixes it)."""
    return int(v) if schedule_facts(name).virtual_configurable else 1


@functools.lru_cache(maxsize=4096)
def _fact(kind: str, name: str, p: int, m: int, v: int) -> list:
    """``_DERIVE[kind]`` of ``schedule_facts(name).order(p, m, v)`` as JSON data, from disk when an
    earlier process derived it (each kind its own entry: a search that needs only the placement
    of a schedule derives nothing else); raises the IR's ScheduleError on a refused shape."""
    key = f"{kind} {name} {p} {m} {v}"
    raw = disk_cache.load("schedules", code_version(), key)
    if raw is not None:
        try:
            return json.loads(raw)
        except ValueError:
            pass   # a damaged entry: derived again and rewritten below
    value = _DERIVE[kind](schedule_facts(name).order(p, m, v))
    disk_cache.store("schedules", code_version(), key, json.dumps(value).encode())
    return value


@functools.lru_cache(maxsize=1024)
def placement(name: str, p: int, m: int, v: int = 1) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(stage -> rank, peak (stage, micro-batch) chunks holding activations per rank)."""
    s2r, inflight = _fact("placement", name, p, m, normalised_v(name, v))
    return tuple(s2r), tuple(inflight)


@functools.lru_cache(maxsize=1024)
def rank_ends(name: str, p: int, m: int, v: int = 1) -> tuple:
    """Per rank: (stage of its first compute, (ends in dx?, stage of its last compute), its stages)."""
    return tuple((f, (bool(dx), s), tuple(st)) for f, (dx, s), st in _fact("rank_ends", name, p, m, normalised_v(name, v)))


@functools.lru_cache(maxsize=1024)
def fsdp_gathers(name: str, p: int, m: int, v: int = 1) -> tuple[int, ...]:
    """All-gathers of a block's FSDP unit per stage in one step."""
    return tuple(_fact("gathers", name, p, m, normalised_v(name, v)))


def clear() -> None:
    """Forget what this process derived (the disk entries stay): tests time a fresh process."""
    for f in (_fact, placement, rank_ends, fsdp_gathers):
        f.cache_clear()
