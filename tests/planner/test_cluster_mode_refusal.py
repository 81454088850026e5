"""A dp mode the constraints fix but the asked mesh cannot run is refused with the reason (not a
bare "nothing fits", which reads as a memory problem); with one data-parallel rank the mode is
moot and the plan is made."""
import pytest

from autoplan import plan_cluster
from autoplan.errors import InfeasiblePlanError
from tests.runtime.ep_workers import build


def _moe():
    model = build("mixtral")[0].to("meta")
    model.config.use_cache = False
    return model


def test_zero1_with_ep_names_the_reason():
    with pytest.raises(InfeasiblePlanError, match="dp_mode='zero1' with ep or cp: those meshes run FSDP"):
        plan_cluster(_moe(), 8, hardware="cpu", batch=(8, 8), devices_per_node=8,
                     constraints={"dp": 2, "ep": 2, "pp": 1, "tp": 2, "dp_mode": "zero1", "expert_parallel": True})


def test_one_dp_rank_makes_the_mode_moot():
    plan = plan_cluster(_moe(), 4, hardware="cpu", batch=(8, 8), devices_per_node=4,
                        constraints={"dp": 1, "ep": 2, "pp": 1, "tp": 2, "dp_mode": "zero1", "expert_parallel": True})
    assert dict(zip(plan.mesh["names"], plan.mesh["shape"]))["ep"] == 2
