"""A dp mode the constraints fix but the asked mesh cannot run is refused with the reason (not a
bare "nothing fits", which reads as a memory problem): cp plans run FSDP over dp x cp. With ep,
ZeRO-1 is a mode like the others (the non-expert optimizer state over dp x ep, the experts' over
dp), also at one data-parallel rank, where it shards over ep alone."""
import pytest

from autoplan import plan_cluster
from autoplan.errors import InfeasiblePlanError
from tests.runtime.ep_workers import build


def _moe():
    model = build("mixtral")[0].to("meta")
    model.config.use_cache = False
    return model


def test_zero1_with_cp_names_the_reason():
    with pytest.raises(InfeasiblePlanError, match="dp_mode='zero1' with cp: those meshes run FSDP"):
        plan_cluster(_moe(), 8, hardware="cpu", batch=(8, 8), devices_per_node=8,
                     constraints={"dp": 2, "cp": 2, "pp": 1, "tp": 2, "dp_mode": "zero1"})


@pytest.mark.parametrize("dp", [1, 2])
def test_zero1_with_ep_is_planned(dp):
    plan = plan_cluster(_moe(), 4 * dp, hardware="cpu", batch=(8, 8), devices_per_node=4 * dp,
                        constraints={"dp": dp, "ep": 2, "pp": 1, "tp": 2, "dp_mode": "zero1", "expert_parallel": True})
    assert dict(zip(plan.mesh["names"], plan.mesh["shape"]))["ep"] == 2
    assert plan.fsdp["mode"] == "zero1"
    assert any(r["mesh_dim"] == "dp_ep" and r["kind"] == "reduce_scatter" for r in plan.predictions["collectives"])
