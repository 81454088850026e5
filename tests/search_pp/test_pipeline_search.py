"""Cut search vs brute force, compiled timing vs the simulator, and the joint search's contracts
(fast, no ranks). The uniform-bubble formulas are tested in tests/pipeline/test_schedule_ir.py."""
import itertools
import random

import pytest

from autoplan.search.pipeline.search import (
    UnitCost, balanced_cuts, even_starts, full_lower_bound, pipeline_candidates, play_costs, ramp_floor,
    search_pipeline, stage_bounds,
)
from hyper_parallel.core.pipeline_parallel import StageCost, schedule_facts, simulate


def _all_starts(n, k):
    for inner in itertools.combinations(range(1, n), k - 1):
        yield [0, *inner]


def _brute(times, states, acts, k, inflight, budgets):
    best = None
    for st in _all_starts(len(times), k):
        ok, worst = True, 0.0
        for j, (a, b) in enumerate(stage_bounds(st, len(times))):
            if sum(states[a:b]) + inflight[j] * sum(acts[a:b]) > budgets[j]:
                ok = False
                break
            worst = max(worst, sum(times[a:b]))
        if ok and (best is None or worst < best):
            best = worst
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_cuts_equal_brute_force_bottleneck(seed):
    rng = random.Random(seed)
    n, k = rng.randint(3, 11), rng.randint(1, 4)
    times = [rng.uniform(0.1, 3.0) for _ in range(n)]
    states = [rng.uniform(0, 2) for _ in range(n)]
    acts = [rng.uniform(0, 1) for _ in range(n)]
    inflight = sorted((rng.randint(1, 4) for _ in range(k)), reverse=True)  # earlier stages hold more
    budgets = [rng.uniform(3, 12)] * k
    want = _brute(times, states, acts, k, inflight, budgets)
    got = balanced_cuts(times, states, acts, k, inflight, budgets)
    if want is None:
        assert got is None
        return
    assert got is not None and got[0] == 0 and len(got) == k
    worst = max(sum(times[a:b]) for a, b in stage_bounds(got, n))
    assert worst == pytest.approx(want, rel=1e-9)
    for j, (a, b) in enumerate(stage_bounds(got, n)):
        assert sum(states[a:b]) + inflight[j] * sum(acts[a:b]) <= budgets[j] + 1e-9


def test_heavy_head_gets_fewer_layers_than_the_even_split():
    units = [UnitCost("emb", 0.1, 0.1, 0.0)] + [UnitCost(f"l{i}", 1, 1, 1) for i in range(8)] + \
            [UnitCost("norm", 0.01, 0.01, 0.0), UnitCost("head", 3, 3, 3)]
    best = search_pipeline(units, 2, [8], 1e30, 0.0)[0]
    assert even_starts(len(units), 2) == [0, 5]
    ends = stage_bounds(best.starts, len(units))
    assert ends[-1][1] - ends[-1][0] < 6  # the head's stage holds fewer than 4 blocks + norm + head


@pytest.mark.parametrize("name,v", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZeroBubble", 1),
                                    ("ZBV", 2)])
def test_compiled_timing_equals_the_simulator(name, v):
    rng = random.Random(3)
    p, m = 4, 8
    costs = [StageCost(rng.random(), rng.random(), rng.random()) for _ in range(p * v)]
    ref = simulate(schedule_facts(name).ir(p, m, v), costs, 0.07)
    step, bubble, busy, peaks = play_costs(name, p, m, v, costs, 0.07)
    assert step == pytest.approx(ref.step_time, rel=1e-12)
    assert bubble == pytest.approx(ref.bubble_fraction, abs=1e-12)
    assert busy == pytest.approx(ref.busy, rel=1e-12) and peaks == ref.peak_inflight


def test_search_is_exact_against_simulating_every_candidate():
    rng = random.Random(7)
    units = [UnitCost(f"u{i}", rng.uniform(.5, 1.5), rng.uniform(.5, 1.5), rng.uniform(.2, .8), 1.0, 0.5)
             for i in range(12)]
    best = search_pipeline(units, 4, [4, 8, 16], 40.0, 0.05)[0]
    from autoplan.search.pipeline.search import time_choice
    every = [time_choice(c, units, 0.05) for c in pipeline_candidates(units, 4, [4, 8, 16], 40.0)]
    assert best.step_s == pytest.approx(min(c.step_s for c in every if max(c.rank_memory) <= 40.0))
    assert all(full_lower_bound(c, units) <= c.step_s + 1e-12 for c in every)
    for c in every:
        if c.v == 1:  # the schedule-free floor used to skip generating a schedule is below every step
            assert ramp_floor(units, 4, c.m) <= c.sim_step_s + 1e-9


@pytest.mark.parametrize("seed", range(10))
def test_ramp_floor_equals_brute_force(seed):
    rng = random.Random(seed)
    n, p, m = rng.randint(3, 9), rng.randint(1, 3), rng.randint(1, 6)
    units = [UnitCost(f"u{i}", rng.uniform(.1, 1), rng.uniform(.1, 1), rng.uniform(0, 1)) for i in range(n)]
    want = min(max(sum(u.forward for u in units[:a]) + m * sum(u.time for u in units[a:b])
                   for a, b in stage_bounds(st, n)) for st in _all_starts(n, p))
    assert ramp_floor(units, p, m) == pytest.approx(want, rel=1e-9)


def test_memory_limit_is_respected_with_in_flight_micro_batches():
    units = [UnitCost(f"u{i}", 1, 1, 1, state_bytes=1.0, act_bytes=1.0) for i in range(8)]
    for c in search_pipeline(units, 2, [8], 16.0, 0.0):
        assert max(c.rank_memory) <= 16.0
