"""Pipelined plans in ZeRO-1 and with selective recomputation equal one device on gloo (loss rtol
1e-5, SGD-updated parameters rtol 1e-4 / atol 1e-6; gradients too where a rank holds them whole,
i.e. not under ZeRO-1)."""
import pytest

from autoplan import plan_cluster
from tests.planner.e2e_workers import build
from tests.search_pp.workers import run_pipeline_case

BATCH, SEQ = 8, 16
CASES = [  # constraints, planner options
    ({"pp": 2, "tp": 2, "dp": 1, "recompute": "selective"}, dict(allow_replicated_units=False, sequence_parallel=False)),
    ({"pp": 2, "tp": 1, "dp": 2, "dp_mode": "zero1", "recompute": "selective"}, {}),
]


def test_pipelined_modes_match_one_device(pool4):
    for cons, opts in CASES:
        plan = plan_cluster(build("llama", device="meta"), 4, hardware="cpu", batch=(BATCH, SEQ), devices_per_node=4,
                            constraints=cons, **opts)
        assert plan.recompute_mode == "selective" and plan.pipeline["pp"] == 2
        for r in pool4.run(run_pipeline_case, plan.to_json(), "llama", BATCH, SEQ):
            assert r["par"] == pytest.approx(r["ref"], rel=1e-5), (cons, r)
            assert not r["bad_params"], (cons, r)
            if cons.get("dp_mode") != "zero1":
                assert not r["bad_grads"], (cons, r)
