"""The runtime's table of per-schedule facts matches what the generators emit, unknown names fail
with a typed error, and the planner, plan runner, plan schema and cost model read the table instead
of keeping their own copies. Torch-free apart from imports; fast."""
import re
from pathlib import Path

import pytest

from autoplan import arguments, cluster, request
from autoplan.parallelisms import pipeline as pipeline_parallelism
from autoplan.plan import pipeline_runner, schema
from autoplan.review import stages as review_stages
from autoplan.search.mesh import search as mesh_search
from autoplan.search.pipeline import schedule_timing
from autoplan.search.pipeline import search as pipeline_search
from cost_models import memory
from hyper_parallel.core import pipeline_parallel
from hyper_parallel.core.pipeline_parallel import SCHEDULE_NAMES, SCHEDULES, StageCost, schedule_facts, simulate
from hyper_parallel.core.pipeline_parallel.schedule_ir import ActionKind
from hyper_parallel.errors import ScheduleError, UnknownScheduleError

ROOT = Path(__file__).resolve().parents[2]
GRID = [(1, 1), (2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (4, 12), (8, 16)]


def _cases():
    for name, f in SCHEDULES.items():
        for p, m in GRID:
            for v in ((2, 3) if f.virtual_configurable else (1,)):
                yield name, p, m, v


def _open_chunks_peak(prog) -> int:
    """Independent count: the set of (stage, micro-batch) chunks whose forward ran and whose last
    backward piece has not (B, or W when split)."""
    live, peak = set(), 0
    for a in prog:
        if a.kind is ActionKind.FORWARD:
            live.add((a.stage, a.microbatch))
        elif a.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
            live.discard((a.stage, a.microbatch))
        peak = max(peak, len(live))
    return peak


@pytest.mark.parametrize("name,p,m,v", list(_cases()))
def test_table_matches_the_generated_schedule(name, p, m, v):
    f = schedule_facts(name)
    ir = f.schedule_class.ir(p, m, **f.generator_kwargs(v))   # the runtime class's own IR, uncached
    assert ir.name == name
    assert [a for prog in f.ir(p, m, v).actions for a in prog] == [a for prog in ir.actions for a in prog]
    assert all(len(ir.stages_of(r)) == f.stages_per_rank(v) for r in range(p))
    assert ir.n_stages == f.n_stages(p, v)
    kinds = {a.kind for prog in ir.actions for a in prog}
    assert f.split_backward == bool(kinds & {ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})
    assert f.split_backward == ir.uses_split_backward
    assert f.inflight(p, m, v) == tuple(_open_chunks_peak(prog) for prog in ir.actions)
    for r in range(p):
        assert f.inflight_microbatches(p, m, r, v) == f.inflight(p, m, v)[r] / f.stages_per_rank(v)
    if p > 1:   # the closed form equals the simulator on uniform stages (T_F = T_I = T_W)
        sim = simulate(ir, StageCost(1.0, 1.0, 1.0))
        assert f.bubble_fraction(p, m, v) == pytest.approx(sim.bubble_fraction, abs=1e-12)
        assert list(f.inflight(p, m, v)) == sim.peak_inflight


def test_known_values_of_the_table():
    """The literature's numbers where this runtime follows it (formulas.md)."""
    facts = {n: schedule_facts(n) for n in SCHEDULE_NAMES}
    assert facts["GPipe"].inflight(4, 16) == (16,) * 4
    assert facts["1F1B"].inflight(4, 16) == (4, 3, 2, 1)
    assert facts["Interleaved1F1B"].inflight_microbatches(4, 16, 0, 2) == pytest.approx(4 * (1 + 3 / 8))
    assert facts["ZBV"].inflight_microbatches(4, 16, 3) == 4
    # this runtime's ZB-H1 (greedy, no W cap) defers dw past the last forward: all m are held until W
    assert facts["ZeroBubble"].inflight(4, 16) == (16,) * 4
    assert [facts[n].stages_per_rank(4) for n in SCHEDULE_NAMES] == [1, 1, 4, 1, 2]
    assert [facts[n].split_backward for n in SCHEDULE_NAMES] == [False, False, False, True, True]
    assert [facts[n].bubble_coefficient for n in SCHEDULE_NAMES] == [1.0, 1.0, 1.0, 1 / 3, 1 / 6]
    assert facts["Interleaved1F1B"].bubble_fraction(4, 8, 2) == 3 / 16


def test_torch_counterparts_exist():
    import torch.distributed.pipelining as tpp

    for f in SCHEDULES.values():
        assert isinstance(getattr(tpp, f.torch_class), type)


@pytest.mark.parametrize("bad", ["1f1b", "zbv", "ZB-H1", "", None, 3])
def test_unknown_schedule_is_a_typed_error_naming_the_valid_ones(bad):
    with pytest.raises(UnknownScheduleError) as e:
        schedule_facts(bad, "plan.pipeline['schedule']")
    msg = str(e.value)
    assert "plan.pipeline['schedule']" in msg and all(n in msg for n in SCHEDULE_NAMES)
    assert isinstance(e.value, ScheduleError) and isinstance(e.value, ValueError)
    with pytest.raises(UnknownScheduleError):
        memory.inflight_microbatches(bad, 4, 8)


def test_rank_out_of_range_is_refused():
    with pytest.raises(ScheduleError, match="rank=4"):
        schedule_facts("1F1B").inflight_microbatches(4, 8, 4)


def test_plan_schema_enum_is_the_table():
    enum = schema.plan_schema()["properties"]["parallel"]["properties"]["pp"]["oneOf"][1]["properties"]["schedule"]["enum"]
    assert tuple(enum) == SCHEDULE_NAMES


def test_consumers_read_the_table():
    """The modules that used to keep their own copies now hold the table's functions."""
    for mod in (pipeline_runner, pipeline_parallelism, review_stages, mesh_search, pipeline_search, schedule_timing,
                memory, cluster):
        assert getattr(mod, "schedule_facts", None) is schedule_facts, mod.__name__
    for mod in (arguments, cluster, request, pipeline_search):   # the names searched and accepted
        assert getattr(mod, "SCHEDULE_NAMES", None) is SCHEDULE_NAMES, mod.__name__
    for mod, gone in ((pipeline_runner, "_CLASSES"), (pipeline_search, "SPLIT_BACKWARD"), (pipeline_search, "SCHEDULES"),
                      (pipeline_search, "uniform_inflight"), (pipeline_search, "schedule_virtual"),
                      (mesh_search, "BUBBLE"), (mesh_search, "SPLIT_WEIGHT"), (schedule_timing, "schedule_ir"),
                      (memory, "Schedule"), (schema, "_stages")):
        assert not hasattr(mod, gone), f"{mod.__name__}.{gone} is a copy of the schedule table"


_NAMES = "|".join(re.escape(n) for n in SCHEDULE_NAMES)
_LEGACY = r"gpipe|1f1b|interleaved_1f1b|zb_h1|zb_h2|zbv"
# a per-schedule fact written by hand: a comparison with a name, a name as a dict key, a name in a
# membership test, or the cost model's old lowercase vocabulary
_HAND_WRITTEN = re.compile(
    rf"""[=!]=\s*["']({_NAMES})["']|["']({_NAMES})["']\s*:|\bin\s*[({{\[][^)}}\]]*["']({_NAMES})["']"""
    rf"""|["']({_LEGACY})["']""")
_OWNERS = {"hyper_parallel/core/pipeline_parallel/schedule_facts.py", "hyper_parallel/core/pipeline_parallel/generators.py"}


def _exported(match) -> bool:
    """A lowercase name that is a generator function the package exports (``__all__`` lists)."""
    return bool(match.group(4)) and hasattr(pipeline_parallel, match.group(4))


def test_no_schedule_fact_is_written_by_hand_outside_the_table():
    hits = []
    for pkg in ("autoplan", "cost_models", "hyper_parallel", "benchmarks"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in _OWNERS:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if any(not _exported(mt) for mt in _HAND_WRITTEN.finditer(line)):
                    hits.append(f"{rel}:{i}: {line.strip()}")
    assert not hits, "read these from hyper_parallel.core.pipeline_parallel.schedule_facts:\n" + "\n".join(hits)


def test_the_hand_written_pattern_can_fail():
    for line in ('if name == "ZBV":', 'x = {"GPipe": 1.0}', 'if s in ("ZeroBubble", "ZBV"):',
                 'schedule: Literal["gpipe", "1f1b"]'):
        assert _HAND_WRITTEN.search(line), line
    for line in ('schedule: str = "1F1B"', 'MEGATRON_SCHEDULES = ("1F1B", "Interleaved1F1B")'):
        assert not _HAND_WRITTEN.search(line), line
