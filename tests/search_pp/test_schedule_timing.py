"""The planner's compiled schedule timing (autoplan/search/pipeline/schedule_timing.py) against the
simulator on every schedule, uneven micro-batch counts, one to several stages per rank: the
compiled form keeps only the receives' waits, so a schedule whose local order mattered
beyond them would show here."""
import random

import pytest

from autoplan.search.pipeline.schedule_timing import compile_schedule, time_schedule
from hyper_parallel.core.pipeline_parallel import SCHEDULE_NAMES, StageCost, schedule_facts, simulate
from hyper_parallel.errors import ScheduleError


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_compiled_timing_equals_the_simulator(name):
    rng = random.Random(name)
    for p, m, v in [(1, 1, 1), (2, 3, 2), (3, 5, 1), (4, 8, 2), (4, 6, 3), (5, 12, 2)]:
        try:
            ir = schedule_facts(name).ir(p, m, v)
        except ScheduleError:
            continue   # a shape this schedule refuses
        costs = [StageCost(rng.random(), rng.random(), rng.random() * (name != "1F1B")) for _ in range(ir.n_stages)]
        for p2p in (0.0, 0.05, 2.0):
            ref = simulate(ir, costs, p2p)
            step, busy = time_schedule(compile_schedule(name, p, m, v), costs, p2p)
            assert step == pytest.approx(ref.step_time, rel=1e-12, abs=1e-12), (p, m, v, p2p)
            assert busy == pytest.approx(list(ref.busy), rel=1e-12, abs=1e-12), (p, m, v, p2p)
