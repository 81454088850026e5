"""MPipe in the schedule IR, torch-free: the transform composes with every schedule, the
validator rejects malformed MPipe programs naming the fault, and the simulator's step time equals
the formulas written in mpipe_ir.py exactly on uniform costs."""
import itertools

import pytest

from hyper_parallel.core.pipeline_parallel import (
    ActionKind, build_schedule, lower, mpipe, preprocess_owner, simulate, validate_schedule,
)
from hyper_parallel.core.pipeline_parallel.schedule_ir import PB, PF, Action, from_orders
from hyper_parallel.core.pipeline_parallel.simulator import StageCost
from hyper_parallel.errors import ScheduleError

K = ActionKind


@pytest.mark.parametrize("name", ["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble", "ZBV"])
@pytest.mark.parametrize("placement", ["front", "timed"])
def test_mpipe_composes_with_every_schedule(name, placement):
    for p, m in [(2, 4), (4, 8), (4, 4), (4, 2)]:
        if name in ("Interleaved1F1B",) and m % p:
            continue
        ir = validate_schedule(lower(mpipe(build_schedule(name, p, m), placement)))
        assert ir.meta["preprocess"] and ir.name == f"MPipe({name})"
        kinds = [a.kind for prog in ir.actions for a in prog]
        assert kinds.count(K.PRE_F) == m and kinds.count(K.PRE_B) == m
        assert kinds.count(K.REDUCE_PRE) == p
        remote = sum(preprocess_owner(ir.stage_to_rank, mb) != ir.stage_to_rank[0] for mb in range(m))
        for k in (K.SEND_PRE, K.RECV_PRE, K.SEND_PRE_B, K.RECV_PRE_B):
            assert kinds.count(k) == remote, (k, p, m)
        for r, prog in enumerate(ir.actions):   # every tower action on its owner
            for a in prog:
                if a.kind in (K.PRE_F, K.PRE_B, K.SEND_PRE, K.RECV_PRE_B):
                    assert preprocess_owner(ir.stage_to_rank, a.microbatch) == r
            assert prog[-1].kind is K.REDUCE_PRE


def test_owner_is_round_robin_from_stage_zero():
    assert [preprocess_owner((0, 1, 2, 3), mb) for mb in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [preprocess_owner((0, 1, 1, 0), mb) for mb in range(3)] == [0, 1, 0]  # ZBV's V


def _bad(orders, p=2, m=2, fsdp=False):
    s = from_orders("bad", m, tuple(range(p)), orders)
    s.meta["preprocess"] = True
    with pytest.raises(ScheduleError) as e:
        validate_schedule(s)
    return str(e.value)


def _good(p=2, m=2):
    return lower(mpipe(build_schedule("1F1B", p, m)))


def test_validator_rejects_malformed_mpipe_programs():
    g = _good()
    orders = [list(prog) for prog in g.actions]
    # a tower forward missing
    o = [[a for a in prog if a != PF(1)] for prog in orders]
    assert "tower forward of micro-batch 1 runs 0 times" in _bad(o)
    # a tower forward on the wrong rank (micro-batch 1 belongs to rank 1)
    o = [list(orders[0]), [a for a in orders[1] if a != PF(1)]]
    o[0].insert(0, PF(1))
    assert "must run on its micro-batch's tower owner, rank 1" in _bad(o)
    # the tower backward before its gradient arrives / before its forward
    o = [list(orders[0]), [a for a in orders[1] if a != PB(1)]]
    o[1].insert(o[1].index(PF(1)) + 1, PB(1))   # before RECV_PRE_B
    msg = _bad(o)
    assert "PB1" in msg and "RECV_PRE_B" in msg
    o = [list(orders[0]), [a for a in orders[1] if a != PF(1)]]
    o[1].append(PF(1))
    assert "later on the same rank" in _bad(o) or "deadlock" in _bad(o)
    # a transposed send without its receive
    o = [[a for a in orders[0] if a.kind is not K.RECV_PRE], list(orders[1])]
    msg = _bad(o)
    assert "RECV_PRE" in msg
    # REDUCE_PRE missing on one rank, or before a tower backward
    o = [list(orders[0]), [a for a in orders[1] if a.kind is not K.REDUCE_PRE]]
    assert "REDUCE_PRE 0 times" in _bad(o)
    o = [list(orders[0]), [a for a in orders[1] if a.kind is not K.REDUCE_PRE]]
    o[1].insert(0, Action(K.REDUCE_PRE, 0))
    assert "comes after REDUCE_PRE" in _bad(o)
    # MPipe actions in a schedule that is not MPipe
    s = from_orders("plain", 2, (0, 1), orders)
    with pytest.raises(ScheduleError, match="not an MPipe schedule"):
        validate_schedule(s)
    # a transposed send between stage 0's rank and itself
    o = [list(orders[0]), list(orders[1])]
    o[0].insert(1, Action(K.SEND_PRE, 0, 0))
    assert "its own rank" in _bad(o) or "must run on" in _bad(o)


def test_mpipe_arguments_are_checked():
    with pytest.raises(ScheduleError, match="placement"):
        mpipe(build_schedule("1F1B", 2, 2), placement="early")
    with pytest.raises(ScheduleError, match="already"):
        mpipe(mpipe(build_schedule("1F1B", 2, 2)))
    with pytest.raises(ScheduleError, match="preprocess_cost"):
        simulate(mpipe(build_schedule("1F1B", 2, 2)), StageCost(1, 1))


def t_tower_on_stage0(p, m, tf, tb, tv, tvb):
    """The formula in mpipe_ir.py: 1F1B with the tower inside stage 0."""
    return m * (tf + tb + tv + tvb) + (p - 1) * (max(0, tb - tv) + max(0, tf - tvb))


def t_mpipe(p, m, tf, tb, tv, tvb):
    """The formula in mpipe_ir.py: MPipe ("front" placement), m a multiple of p."""
    return (m + p - 1) * (tf + tb) + (m // p) * (tv + tvb)


def test_simulator_matches_the_step_time_formulas():
    n = 0
    for p, k in [(2, 1), (2, 3), (3, 2), (4, 1), (4, 2)]:
        m = p * k
        base = build_schedule("1F1B", p, m)
        ms = mpipe(base)
        for tf, tb, tv, tvb in itertools.product([1, 2], [1, 2, 3], [0.5, 2, 6], [0, 1, 4]):
            got = simulate(ms, StageCost(tf, tb), preprocess_cost=StageCost(tv, tvb)).step_time
            assert got == pytest.approx(t_mpipe(p, m, tf, tb, tv, tvb), abs=1e-9), (p, m, tf, tb, tv, tvb)
            on0 = simulate(base, [StageCost(tf + tv, tb + tvb)] + [StageCost(tf, tb)] * (p - 1)).step_time
            assert on0 == pytest.approx(t_tower_on_stage0(p, m, tf, tb, tv, tvb), abs=1e-9)
            n += 1
    assert n == 5 * 54


def test_reduce_time_is_a_collective_at_the_end():
    ms = mpipe(build_schedule("1F1B", 4, 8))
    a = simulate(ms, StageCost(1, 2), preprocess_cost=StageCost(1, 1)).step_time
    b = simulate(ms, StageCost(1, 2), preprocess_cost=StageCost(1, 1), reduce_time=5).step_time
    assert b == a + 5
