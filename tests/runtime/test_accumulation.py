"""Gradient accumulation at pp=1 on gloo ranks: plan_cluster's one-stage plans with m > 1
micro-batches (Runner.forward_backward) train one step equal to one device -- loss, every
gradient, every parameter after an SGD step, every parameter perturbed -- under FSDP dp4, FSDP
dp2 x tp2, replicated dp, ZeRO-1 and context parallelism (FSDP over dp x cp), on Llama and
Qwen2; and a batch the micro-batches do not divide fails on every rank before any forward."""
import pytest

from autoplan import plan_cluster
from autoplan.verify.numerics import RTOL_LOSS
from tests.planner.e2e_workers import build
from tests.runtime import accumulation_workers

CASES = [  # label, model, global batch, constraints (all pp=1 with micro-batches)
    ("fsdp_dp4", "llama", 16, {"tp": 1, "dp": 4, "microbatches": 2, "fsdp": True}),
    ("fsdp_dp2_tp2", "hf_qwen2", 8, {"tp": 2, "dp": 2, "microbatches": 2, "fsdp": True}),
    ("replicate_dp4", "hf_qwen2", 8, {"tp": 1, "dp": 4, "microbatches": 2, "dp_mode": "replicate"}),
    ("zero1_dp2_tp2", "hf_qwen2", 16, {"tp": 2, "dp": 2, "microbatches": 4, "dp_mode": "zero1"}),
    ("cp_dp2_cp2", "llama", 4, {"cp": 2, "dp": 2, "microbatches": 2}),
]


def _plan(name, gb, cons):
    return plan_cluster(build(name, device="meta"), 4, hardware="cpu", batch=(gb, 16), devices_per_node=4,
                        constraints=dict(cons, pp=1), memory_limit=1e12)


@pytest.fixture(scope="module")
def results(pool4):
    plans = {label: _plan(name, gb, cons) for label, name, gb, cons in CASES}
    for label, _, _, cons in CASES:
        assert plans[label].pipeline["microbatches"] == cons["microbatches"], label
    cases = [(label, plans[label].to_json(), name, gb) for label, name, gb, _ in CASES]
    bad = (plans["fsdp_dp2_tp2"].to_json(), "hf_qwen2", 3)   # 3 local rows, 2 micro-batches
    return plans, pool4.run(accumulation_workers.run_cases, cases, bad)


@pytest.mark.parametrize("label", [c[0] for c in CASES])
def test_accumulated_step_equals_one_device(results, label):
    plans, per_rank = results
    for rank, out in enumerate(per_rank):
        r = out[label]
        where = f"{label} rank {rank}"
        assert abs(r["par"] - r["ref"]) <= RTOL_LOSS * abs(r["ref"]), f"{where}: loss {r['par']} vs {r['ref']}"
        assert r["bad_grads"] == [], f"{where}: gradients differ {r['bad_grads']}"
        assert r["bad_params"] == [], f"{where}: parameters after the step differ {r['bad_params']}"
        assert r.get("n_grads", 1) > 0 and r.get("grad_slice_ok", True), where   # ZeRO-1: its reduced slice


def test_undivided_batch_fails_on_every_rank_before_any_forward(results):
    _, per_rank = results
    for rank, out in enumerate(per_rank):
        r = out["undivided"]
        assert r["error"] and "3 rows" in r["error"] and "microbatches=2" in r["error"], (rank, r)
        assert r["grads"] == 0 and r["world"] == 4.0, (rank, r)
        assert r["passes"] == [2, 2], (rank, r)   # 4 local rows: two forwards of 2
