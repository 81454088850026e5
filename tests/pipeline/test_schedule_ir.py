"""Schedule generators, validator and simulator: torch-free, fast."""
import pytest

from hyper_parallel.core.pipeline_parallel.generators import (
    gpipe, interleaved_1f1b, one_f_one_b, zbv, zero_bubble_h1,
)
from hyper_parallel.core.pipeline_parallel.schedule_facts import SCHEDULE_NAMES, build_schedule
from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    ActionKind, B, F, I, W, from_orders, lower,
)
from hyper_parallel.core.pipeline_parallel.simulator import StageCost, simulate
from hyper_parallel.core.pipeline_parallel.validator import validate_schedule
from hyper_parallel.errors import ScheduleError


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (2, 4), (4, 4), (4, 8), (3, 6)])
def test_every_generated_schedule_validates(name, p, m):
    lowered = validate_schedule(build_schedule(name, p, m))
    assert lowered.is_lowered or p == 1
    # every stage runs every micro-batch's forward exactly once
    fwd = sorted((a.stage, a.microbatch) for prog in lowered.actions for a in prog
                 if a.kind is ActionKind.FORWARD)
    assert fwd == sorted((s, i) for s in range(lowered.n_stages) for i in range(m))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (4, 12), (8, 16)])
def test_uniform_bubbles_match_formulas(p, m):
    even = StageCost(1.0, 0.5, 0.5)
    assert simulate(gpipe(p, m), even).bubble_fraction == pytest.approx((p - 1) / m)
    assert simulate(one_f_one_b(p, m), even).bubble_fraction == pytest.approx((p - 1) / m)
    for v in (2, 3):
        per_chunk = StageCost(1.0 / v, 0.5 / v, 0.5 / v)
        res = simulate(interleaved_1f1b(p, m, v), per_chunk)
        assert res.bubble_fraction == pytest.approx((p - 1) / (v * m))
    zb = simulate(zero_bubble_h1(p, m), StageCost(1.0, 1.0, 1.0))
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m))
    half = StageCost(0.5, 0.5, 0.5)   # ZBV: two half-size stages per rank
    assert simulate(zbv(p, m), half).bubble_fraction < zb.bubble_fraction


def test_simulation_reports_timeline_memory_and_p2p_cost():
    res = simulate(one_f_one_b(4, 8), StageCost(1.0, 1.0, 1.0))
    assert res.peak_inflight == [4, 3, 2, 1]            # 1F1B: p - r in flight on rank r
    assert simulate(gpipe(4, 8), StageCost(1, 1, 1)).peak_inflight == [8] * 4
    tl = res.timeline
    assert set(tl.columns) >= {"rank", "action", "start", "end"}
    assert tl["end"].max() == pytest.approx(res.step_time) == pytest.approx((8 + 3) * 3.0)
    slower = simulate(one_f_one_b(4, 8), StageCost(1.0, 1.0, 1.0), p2p_time=0.25)
    assert slower.step_time > res.step_time
    # uneven stages: the slowest stage sets the pace
    res2 = simulate(gpipe(2, 4), [StageCost(1, 1, 0), StageCost(3, 3, 0)])
    assert res2.step_time == pytest.approx(2 * 4 * 3 + 2 * 1)


def test_validator_rejects_hand_made_deadlock_naming_rank_and_step():
    # rank 1 insists on micro-batch 1 first; rank 0 only sends it after mb 0's gradient came back
    orders = [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)],
              [F(1, 1), B(1, 1), F(1, 0), B(1, 0)]]
    bad = from_orders("hand", 2, (0, 1), orders)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 step 2: RECV_B\(s0,mb0\).*rank 1 step 0: "
                                            r"RECV_F\(s1,mb1\)"):
        validate_schedule(bad)


def test_validator_rejects_local_order_and_unmatched_pairs():
    wrong = from_orders("local", 1, (0, 1), [[B(0, 0), F(0, 0)], [F(1, 0), B(1, 0)]])
    with pytest.raises(ScheduleError, match="rank 0 step 1: 0B0 needs 0F0 which comes later"):
        validate_schedule(wrong)
    lowered = lower(one_f_one_b(2, 2))
    lowered.actions[1] = [a for a in lowered.actions[1] if a.kind is not ActionKind.SEND_B or a.microbatch != 1]
    with pytest.raises(ScheduleError, match=r"rank 0 step \d+: RECV_B\(s0,mb1\) has no matching SEND_B"):
        validate_schedule(lowered)
    split = from_orders("split", 1, (0,), [[F(0, 0), I(0, 0)]], split_backward=True)
    with pytest.raises(ScheduleError, match="rank 0: stage 0 micro-batch 0 has B x0, I x1, W x0"):
        validate_schedule(split)
    ok = from_orders("split", 1, (0,), [[F(0, 0), I(0, 0), W(0, 0)]], split_backward=True)
    validate_schedule(ok)


def test_micro_batch_counts_a_schedule_cannot_use():
    with pytest.raises(ScheduleError, match="n_microbatches=6 is not a multiple of the 4"):
        interleaved_1f1b(4, 6)
    with pytest.raises(ScheduleError, match="positive int"):
        gpipe(2, 0)
    # an IR built for 4 micro-batches run with 3: the first action naming micro-batch 3 is named
    sched = one_f_one_b(2, 4)
    with pytest.raises(ScheduleError, match="built for 4 micro-batches but the step has 3"):
        validate_schedule(sched, n_microbatches=3)
    sched.n_microbatches = 3
    with pytest.raises(ScheduleError, match=r"rank 0 step \d+: 0F3 names micro-batch 3, but the step has 3"):
        validate_schedule(sched)
    # an IR missing a micro-batch on one rank
    short = one_f_one_b(2, 4)
    short.actions[1] = [a for a in short.actions[1] if a.microbatch != 2]
    with pytest.raises(ScheduleError, match="rank 1: stage 1 runs the forward of micro-batch 2 0 times"):
        validate_schedule(short)


def test_fifo_check_for_untagged_backends():
    validate_schedule(one_f_one_b(4, 8), fifo=True)
    orders = [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 1), F(1, 0), B(1, 1), B(1, 0)]]
    swapped = from_orders("swap", 2, (0, 1), orders)
    validate_schedule(swapped)  # fine with tags
    with pytest.raises(ScheduleError, match="rank 1 step 0: receives RECV_F\\(s1,mb1\\)"):
        validate_schedule(swapped, fifo=True)


def test_lowering_inserts_fsdp_actions_and_local_handover():
    low = lower(zbv(2, 2), fsdp=True)
    kinds = [a.kind for a in low.actions[1]]
    assert kinds[0] is ActionKind.UNSHARD and ActionKind.REDUCE_GRAD in kinds
    # stages 1 and 2 both live on rank 1: no send between them
    assert not any(a.kind is ActionKind.SEND_F and a.stage == 1 for a in low.actions[1])
    validate_schedule(low)
    assert "0F0" in zbv(2, 2).format()
    assert len(gpipe(2, 2).to_dataframe()) == 8
