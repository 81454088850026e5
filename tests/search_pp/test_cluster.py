"""plan_cluster's contracts, offline (no ranks): pipeline fields, ranked alternatives, JSON
determinism, constraints, the autoplan(model, N) entry and typed errors."""
import pytest

from autoplan import autoplan, plan_cluster
from autoplan.errors import InfeasiblePlanError, PlanningError
from autoplan.plan import Plan
from autoplan.search.mesh.candidates import mesh_factorizations
from tests.planner.e2e_workers import build


def _model():
    return build("llama", device="meta")


def test_mesh_factorizations_keep_tp_in_a_node():
    got = mesh_factorizations(32, 8, 64)
    assert (4, 1, 8) in got and all(tp <= 8 and dp * pp * tp == 32 for dp, pp, tp in got)
    assert mesh_factorizations(32, 8, 64, {"pp": 2, "tp": 4}) == [(4, 2, 4)]


def test_plan_has_pipeline_and_ranked_alternatives():
    plan = plan_cluster(_model(), 16, hardware="h100_sxm", batch=(64, 32), constraints={"pp": 2})
    pipe = plan.pipeline
    assert pipe["pp"] == 2 and plan.mesh["names"] == ["dp", "pp", "tp"]
    assert sum(len(s) for s in pipe["stages"]) == 5  # embedding, 2 blocks, norm, head
    assert len(pipe["per_stage"]) == len(pipe["stages"]) and pipe["cuts"]
    for row in pipe["per_stage"]:
        assert set(row) >= {"compute_s", "comm_s", "bubble_s", "memory_bytes"}
    steps = [a["step_s"] for a in plan.alternatives]
    assert steps == sorted(steps) and plan.alternatives[0]["step_s"] == pytest.approx(plan.predictions["step_s"])
    assert all({"mesh", "schedule", "step_s"} <= set(a) for a in plan.alternatives)
    assert any(c["kind"] == "send_recv" and c["mesh_dim"] == "pp" for c in plan.predictions["collectives"])
    again = plan_cluster(_model(), 16, hardware="h100_sxm", batch=(64, 32), constraints={"pp": 2})
    assert plan.to_json() == again.to_json()
    assert Plan.from_json(plan.to_json()).pipeline == Plan.from_json(again.to_json()).pipeline


def test_autoplan_with_a_device_count_plans_the_cluster():
    plan = autoplan(_model(), 8, batch=(16, 32), hardware="h100_sxm")
    assert plan.pipeline is not None and plan.mesh["shape"][0] * plan.mesh["shape"][1] * plan.mesh["shape"][2] == 8


def test_typed_errors():
    with pytest.raises(InfeasiblePlanError):
        plan_cluster(_model(), 8, hardware="h100_sxm", batch=(16, 32), memory_limit=1e3)
    with pytest.raises(PlanningError):
        plan_cluster(_model(), 8, hardware="h100_sxm", batch=(16, 32), constraints={"bogus": 1})
    with pytest.raises(InfeasiblePlanError):
        plan_cluster(_model(), 8, hardware="h100_sxm", batch=(16, 32), constraints={"pp": 3})
