"""What the pipeline search reads from a schedule's order, per (schedule, p, m, v), in memory and
on disk (``autoplan.disk_cache``).

Why: the search prices every (schedule, ranks, micro-batches) a mesh allows; each needs its
stage-to-rank map, every rank's peak in-flight chunks (memory), where each rank's work starts and
ends (the lower bound) and how often FSDP gathers each stage's blocks. These come from the
generator's order -- at p=128, m=2048 hundreds of thousands of actions from a greedy list
scheduler, seconds per schedule and most of a cold 405B plan (issue 35) -- yet they are a few
integers per rank and depend on nothing but (schedule, p, m, v) and the generator code. So they
are derived once and kept on disk under the hash of that code; the order itself is generated
only on a miss.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from autoplan import disk_cache
from pathlib import Path

from hyper_parallel.core.pipeline_parallel import generators, schedule_facts
from hyper_parallel.core.pipeline_parallel.schedule_ir import ActionKind as K, peak_inflight

# the generators, the greedy list scheduler, the IR and the schedule table, and this module
_CODE = tuple(str(Path(generators.__file__).with_name(f)) for f in
              ("generators.py", "list_scheduler.py", "schedule_ir.py", "schedule_facts.py")) + (__file__,)


@dataclass(frozen=True)
class ScheduleSummary:
    stage_to_rank: tuple[int, ...]
    inflight: tuple[int, ...]      # per rank: peak (stage, micro-batch) chunks holding activations
    rank_ends: tuple               # per rank: (first compute's stage, (ends in dx?, last stage), its stages)
    gathers: tuple[int, ...]       # per stage: FSDP all-gathers of a block in one step


def code_version() -> str:
    """The version every schedule entry on disk is kept under (generators + this module)."""
    return disk_cache.code_version(*_CODE)


def _summarise(ir) -> ScheduleSummary:
    s2r = tuple(ir.stage_to_rank)
    ends = []
    gathers = [0] * ir.n_stages
    for r, prog in enumerate(ir.actions):
        comp = [a for a in prog if a.is_compute]
        last = comp[-1]
        ends.append((comp[0].stage, (last.kind in (K.BACKWARD, K.BACKWARD_INPUT), last.stage),
                     tuple(s for s, rr in enumerate(s2r) if rr == r)))
        # as the runtime runs FSDP inside a pipeline (fsdp_actions.py): resharded after every
        # forward, kept unsharded after backward until the step ends; a forward or backward that
        # finds it resharded gathers it
        sharded: dict[int, bool] = {}
        for a in prog:
            if a.kind is K.FORWARD:
                gathers[a.stage] += sharded.get(a.stage, True)
                sharded[a.stage] = True
            elif a.kind in (K.BACKWARD, K.BACKWARD_INPUT):
                gathers[a.stage] += sharded.get(a.stage, True)
                sharded[a.stage] = False
    return ScheduleSummary(s2r, tuple(peak_inflight(prog) for prog in ir.actions), tuple(ends), tuple(gathers))


def _from_json(d: dict) -> ScheduleSummary:
    return ScheduleSummary(tuple(d["s2r"]), tuple(d["inflight"]),
                           tuple((f, (bool(dx), s), tuple(st)) for f, (dx, s), st in d["ends"]), tuple(d["gathers"]))


def normalised_v(name: str, v: int) -> int:
    """``v`` as the schedule table reads it (ignored where the schedule fixes it)."""
    return int(v) if schedule_facts(name).virtual_configurable else 1


@functools.lru_cache(maxsize=1024)
def schedule_summary(name: str, p: int, m: int, v: int = 1) -> ScheduleSummary:
    """The summary of ``schedule_facts(name).ir(p, m, v)``; raises its ScheduleError on a shape
    the schedule refuses."""
    v = normalised_v(name, v)
    key = f"summary {name} {p} {m} {v}"
    raw = disk_cache.load("schedules", code_version(), key)
    if raw is not None:
        try:
            return _from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError):
            pass   # a damaged entry: computed again and rewritten below
    out = _summarise(schedule_facts(name).ir(p, m, v))
    disk_cache.store("schedules", code_version(), key, json.dumps(
        {"s2r": out.stage_to_rank, "inflight": out.inflight, "ends": out.rank_ends, "gathers": out.gathers}).encode())
    return out
