"""Pipeline runtime inputs: simulate refuses negative or non-finite costs, even_cuts refuses a
stage count < 1, and ranks that disagree on the schedule's shape fail fast naming both values."""
from __future__ import annotations

import math

import pytest
import torch

from hyper_parallel.core.pipeline_parallel import (
    Schedule1F1B, ScheduleInterleaved1F1B, StageCost, build_schedule, simulate,
)
from hyper_parallel.core.pipeline_parallel.microbatch import split_microbatches
from hyper_parallel.core.pipeline_parallel.split import even_cuts
from hyper_parallel.errors import MicrobatchError, ScheduleError, StageSplitError
from tests.inputs import pipeline_workers
from tests.inputs.helpers import tiny_llama


@pytest.mark.parametrize("args", [(-1.0, 1.0), (1.0, -0.5), (1.0, 1.0, -1e-9), (math.nan, 1.0), (math.inf, 1.0),
                                  ("1", 1.0), (True, 1.0)])
def test_stage_cost_refuses_bad_times(args):
    with pytest.raises(ScheduleError, match="must be a finite number >= 0"):
        StageCost(*args)


def test_simulate_refuses_negative_costs():
    sched = build_schedule("1F1B", 2, 4)
    with pytest.raises(ScheduleError, match="stage 1: StageCost: backward_input=-2.0"):
        simulate(sched, [(1.0, 2.0), (1.0, -2.0)])
    with pytest.raises(ScheduleError, match="must be a StageCost"):
        simulate(sched, [(1.0, 2.0), "fast"])
    with pytest.raises(ScheduleError, match="p2p_time=-1"):
        simulate(sched, StageCost(1.0, 2.0), p2p_time=-1)
    with pytest.raises(ScheduleError, match="got 3 stage costs for 2 stages"):
        simulate(sched, [(1.0, 2.0)] * 3)
    assert simulate(sched, StageCost(1.0, 2.0), p2p_time=0.0).step_time > 0  # legitimate input still works


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_even_cuts_refuses_bad_stage_counts(n):
    with pytest.raises(StageSplitError, match="n_stages=.* must be an integer >= 1"):
        even_cuts(tiny_llama(), n)


def test_even_cuts_one_stage_is_no_cut():
    assert even_cuts(tiny_llama(), 1) == []


def test_ranks_disagreeing_on_schedule_shape_fail_fast(pool2):
    results = pool2.run(pipeline_workers.disagreeing_schedules)
    for rank, res in enumerate(results):
        got = {case: (msg, secs) for case, msg, secs in res}
        msg, secs = got["microbatches"]
        assert msg.startswith("ScheduleError") and "disagree on the number of micro-batches" in msg, msg
        assert f"pipeline rank {rank} has {2 if rank == 0 else 4}" in msg and "from 2 to 4" in msg, msg
        assert secs < 10, f"took {secs:.1f} s: not fail-fast"
        msg, secs = got["schedule"]
        assert "disagree on schedule" in msg and ("GPipe" if rank == 0 else "1F1B") in msg, msg
        assert got["agree"][0] == "ok", got["agree"]


@pytest.mark.parametrize("make, exc, match", [
    (lambda: Schedule1F1B.ir(2, 0), ScheduleError, "n_microbatches must be a positive int, got 0"),
    (lambda: Schedule1F1B.ir(0, 2), ScheduleError, "n_ranks must be a positive int"),
    (lambda: build_schedule("Zigzag", 2, 2), ScheduleError, "schedule='Zigzag' is not a pipeline schedule; valid: \\['GPipe'"),
    (lambda: ScheduleInterleaved1F1B.ir(2, 3, n_virtual=2), ScheduleError, "not a multiple of the 2 pipeline ranks"),
    (lambda: split_microbatches((torch.zeros(4, 2),), {}, 3, None, None), MicrobatchError, "3 micro-batches do not divide"),
    (lambda: split_microbatches((torch.zeros(4, 2),), {}, 0, None, None), MicrobatchError, "positive int, got 0"),
])
def test_schedule_shape_arguments(make, exc, match):
    with pytest.raises(exc, match=match):
        make()
