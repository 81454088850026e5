"""FSDP2's overlap options as a plan states them (``constraints`` ``reshard_after_forward`` and
``prefetch``): the runtime applies them, the plan trains one accumulated step equal to one device on
4 gloo ranks, and the dry run issues exactly the collectives the plan predicts -- no backward
all-gather when blocks stay gathered; the options are refused where there is no FSDP."""
import pytest

from autoplan import plan_cluster
from autoplan.errors import InvalidConstraintError, PlanningError
from autoplan.plan import Plan
from autoplan.verify import verify
from autoplan.verify.numerics import RTOL_LOSS
from tests.planner.e2e_workers import build
from tests.runtime import accumulation_workers

CASES = [  # label, model, global batch, constraints
    ("kept_prefetch1_dp2_tp2", "hf_qwen2", 8,
     {"tp": 2, "dp": 2, "microbatches": 2, "reshard_after_forward": False, "prefetch": 1}),
    ("prefetch2_dp4", "llama", 16, {"tp": 1, "dp": 4, "microbatches": 2, "prefetch": 2}),
]


def _plan(name, gb, cons):
    return plan_cluster(build(name, device="meta"), 4, hardware="cpu", batch=(gb, 16), devices_per_node=4,
                        constraints={"pp": 1, **cons}, memory_limit=1e12)


@pytest.fixture(scope="module")
def plans():
    return {label: _plan(name, gb, cons) for label, name, gb, cons in CASES}


def test_plan_states_the_options_and_drops_the_regathers(plans):
    kept = plans["kept_prefetch1_dp2_tp2"]
    assert kept.fsdp["reshard_after_forward"] is False and kept.fsdp["prefetch"] == 1
    rows = kept.predictions["collectives"]
    assert not [r for r in rows if r["kind"] == "all_gather" and r["phase"] == "backward" and r["mesh_dim"] == "dp"]
    assert kept.predictions["memory_bytes"]["gathered_params"] > 0
    assert Plan.from_json(kept.to_json()).fsdp == kept.fsdp
    default = plans["prefetch2_dp4"]
    assert "reshard_after_forward" not in default.fsdp and default.fsdp["prefetch"] == 2
    assert "gathered_params" not in default.predictions["memory_bytes"]


PIPELINED = ("prefetch1_pp2_dp2", "llama", 8, {"tp": 1, "dp": 2, "pp": 2, "microbatches": 4, "prefetch": 1})


@pytest.mark.parametrize("label", [c[0] for c in CASES] + [PIPELINED[0]])
def test_dry_run_issues_what_the_plan_predicts(plans, label):
    """Every rank's issued collectives and parameter bytes as predicted (a pipeline's each stage)."""
    _, name, gb, cons = next(c for c in CASES + [PIPELINED] if c[0] == label)
    plan = plans[label] if label in plans else _plan(name, gb, cons)
    result = verify(plan, build(name, device="meta"))
    assert result.passed, result


def test_options_train_equal_to_one_device(plans, pool4):
    cases = [(label, plans[label].to_json(), name, gb) for label, name, gb, _ in CASES]
    bad = (plans["prefetch2_dp4"].to_json(), "llama", 3)
    per_rank = pool4.run(accumulation_workers.run_cases, cases, bad)
    for rank, out in enumerate(per_rank):
        for label, *_ in CASES:
            r = out[label]
            where = f"{label} rank {rank}"
            assert abs(r["par"] - r["ref"]) <= RTOL_LOSS * abs(r["ref"]), f"{where}: loss {r['par']} vs {r['ref']}"
            assert r["bad_grads"] == [] and r["bad_params"] == [], (where, r["bad_grads"], r["bad_params"])


@pytest.mark.parametrize("cons, words", [
    ({"dp_mode": "zero1", "prefetch": 1}, "FSDP option"),
    ({"fsdp": False, "reshard_after_forward": False}, "FSDP option"),
    ({"prefetch": -1}, "int >= 0"),
    ({"reshard_after_forward": "no"}, "reshard_after_forward"),
])
def test_options_without_fsdp_are_refused(cons, words):
    with pytest.raises(InvalidConstraintError, match=words):
        _plan("llama", 16, dict(cons, tp=1, dp=4))


def test_kept_gathered_stages_are_refused_in_a_pipeline():
    with pytest.raises(PlanningError, match="pp=2"):
        _plan("llama", 8, {"tp": 1, "dp": 2, "pp": 2, "microbatches": 4, "reshard_after_forward": False})
