"""The planner's choice of where a VL model's tower goes: on stage 0, as its own stage(s),
or MPipe -- priced on the schedule IR (simulate), the tower's time and memory included."""
import pytest

from autoplan.search.pipeline.search import UnitCost
from autoplan.search.pipeline.tower_placement import choose_tower_placement
from tests.pipeline.test_mpipe_ir import t_mpipe, t_tower_on_stage0


def _dec(n, f=1.0, b=2.0, state=10.0, act=1.0):
    return [UnitCost(f"layers.{i}", f, b, 0.0, state, act) for i in range(n)]


def test_prices_equal_the_step_time_formulas():
    # one decoder unit per stage: the cuts are forced, so the formulas of mpipe_ir.py apply as written
    for p, m, tv, tvb in [(4, 8, 0.5, 1.0), (2, 6, 3.0, 4.0), (4, 4, 2.0, 0.0)]:
        tower = UnitCost("visual", tv, tvb, 0.0, 5.0, 1.0)
        got = {c.placement: c for c in choose_tower_placement(tower, _dec(p), p, m)}
        assert got["stage0"].step_s == pytest.approx(t_tower_on_stage0(p, m, 1.0, 2.0, tv, tvb))
        assert got["mpipe"].step_s == pytest.approx(t_mpipe(p, m, 1.0, 2.0, tv, tvb))


def test_picks_mpipe_for_a_heavy_tower_and_stage0_for_a_light_one():
    dec = _dec(16)
    heavy = [UnitCost(f"visual.blocks.{i}", 2.0, 4.0, 0.0, 5.0, 1.0) for i in range(4)]
    assert choose_tower_placement(heavy, dec, 4, 8)[0].placement == "mpipe"
    light = UnitCost("visual", 0.05, 0.1, 0.0, 5.0, 1.0)
    # a tower-gradient all-reduce that costs more than the tower itself: not worth spreading
    best = choose_tower_placement(light, dec, 4, 8, tower_reduce_s=3.0)[0]
    assert best.placement == "stage0"


def test_memory_limit_excludes_replicating_the_tower():
    dec = _dec(8)
    tower = [UnitCost(f"visual.blocks.{i}", 2.0, 4.0, 0.0, 100.0, 1.0) for i in range(4)]
    free = choose_tower_placement(tower, dec, 4, 8)
    assert free[0].placement == "mpipe"
    # every rank holds all 400 bytes of tower state under MPipe; a 300-byte budget rules it out
    tight = choose_tower_placement(tower, dec, 4, 8, memory_limit=300.0)
    assert tight[0].placement != "mpipe" and tight[0].fits
    assert not {c.placement: c for c in tight}["mpipe"].fits


def test_own_stage_gives_the_tower_whole_stages():
    dec = _dec(8)
    tower = [UnitCost(f"visual.blocks.{i}", 3.0, 6.0, 0.0, 5.0, 1.0) for i in range(4)]
    own = {c.placement: c for c in choose_tower_placement(tower, dec, 4, 8)}["own_stage"]
    assert 1 <= own.tower_stages <= 3 and own.starts[0] == 0
    assert own.starts[own.tower_stages] == 4   # the decoder starts on a stage of its own
