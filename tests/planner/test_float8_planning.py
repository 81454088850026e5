"""Precision as a planning dimension: the cluster search prices each Linear's GEMMs in float8 where
the request allows it, the layout moves with it, and the plan states each module's precision."""
import dataclasses

import pytest

from autoplan import autoplan, plan_cluster
from autoplan.errors import InvalidArgumentError, InvalidConstraintError
from autoplan.presets import build_preset
from autoplan.review.report import plan_report
from autoplan.search.pricing.costing import CostContext
from autoplan.search.units.work import Work
from cost_models import load_hardware, mesh_links

MESH = {"shape": [8, 8], "names": ["dp", "tp"]}
TITAN_70B = {"dp": 32, "tp": 8, "pp": 1}   # torchtitan's 70B layout on 256 H100s


@pytest.fixture(scope="module")
def llama70b():
    return build_preset("llama3-70b")


def _plan(model, hardware, **kw):
    return plan_cluster(model, 256, batch=(512, 8192), hardware=hardware, compile="blocks", **kw)


def test_auto_takes_float8_on_h100_where_it_pays_and_is_faster(llama70b):
    bf16 = _plan(llama70b, "h100_sxm", constraints=TITAN_70B)
    auto = _plan(llama70b, "h100_sxm", constraints=dict(TITAN_70B, precision="auto"))
    assert bf16.parallel.get("precision") is None   # float8 is asked for, never assumed
    section = auto.parallel["precision"]
    assert set(section["modules"]) == {f"model.layers.*.{m}" for m in (
        "self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    # k/v at tp 8 (N = 128 a rank) do not pay for their casts; the head stays in high precision
    assert "does not pay" in section["kept"]["model.layers.*.self_attn.k_proj"] and "lm_head" in section["kept"]
    assert section["fsdp_float8_all_gather"]
    assert auto.predictions["step_s"] < 0.9 * bf16.predictions["step_s"]
    assert any(n.startswith("precision: ") for n in auto.notes)
    # reviewed as any other decision: diff and the report show each module's precision
    d = bf16.diff(auto).set_index(["section", "key"])
    assert d.loc[("precision", "model.layers.*.mlp.up_proj"), "b"] == "tensorwise"
    html = plan_report([auto], ["auto"])
    assert "Precision per module" in html and "float8 (tensorwise)" in html and "does not pay" in html


def test_never_on_a100_and_the_plan_does_not_move(llama70b):
    bf16 = _plan(llama70b, "a100_80gb")
    auto = _plan(llama70b, "a100_80gb", precision="auto")
    assert auto.parallel.get("precision") is None
    assert auto.mesh["shape"] == bf16.mesh["shape"] and auto.predictions["step_s"] == bf16.predictions["step_s"]


def test_forced_recipe_takes_every_linear_that_can_run_it(llama70b):
    plan = _plan(llama70b, "h100_sxm", constraints=dict(TITAN_70B), precision="fp8-rowwise")
    modules = plan.parallel["precision"]["modules"]
    assert modules["model.layers.*.self_attn.k_proj"] == "rowwise" and "lm_head" not in modules
    assert not plan.parallel["precision"]["fsdp_float8_all_gather"]   # rowwise weights gather in bf16


def test_precision_arguments_are_checked(llama70b):
    with pytest.raises(InvalidArgumentError, match="precision='fp16'.*valid"):
        _plan(llama70b, "h100_sxm", precision="fp16")
    with pytest.raises(InvalidConstraintError, match=r"constraints\['precision'\]"):
        _plan(llama70b, "h100_sxm", constraints={"precision": "e4m3"})
    with pytest.raises(InvalidArgumentError, match="a100_80gb, which has no float8 GEMM"):
        _plan(llama70b, "a100_80gb", precision="fp8-tensorwise")
    with pytest.raises(InvalidArgumentError, match="contradicts"):
        _plan(llama70b, "h100_sxm", precision="auto", constraints={"precision": "bf16"})


def test_mesh_plans_take_precision_too():
    model = build_preset("llama3-8b", num_layers=2)
    plan = autoplan(model, MESH, batch=(64, 8192), hardware="h100_sxm", precision="fp8-tensorwise")
    assert plan.parallel["precision"]["modules"]["model.layers.*.mlp.down_proj"] == "tensorwise"
    assert autoplan(model, MESH, batch=(64, 8192), hardware="h100_sxm").parallel.get("precision") is None


def _ctx(hardware="h100_sxm", **kw):
    hw = load_hardware(hardware)
    topo = mesh_links((8, 8), ("dp", "tp"), hw)
    return CostContext(hardware=hw, topology=topo, dtype="bf16", tp_dim="tp", dp_dim="dp", dp=8, fsdp=True,
                       param_bytes_per_element=2, optimizer_bytes_per_element=12, runtime=None, **kw)


def test_cost_context_prices_float8_gemms_and_gathers():
    """One 8192 x 8192 projection over 16K rows: float8 runs its GEMMs at the fp8 peak plus casts,
    and FSDP gathers its weight in one byte; a Linear the runtime cannot convert keeps bf16."""
    m, n, k = 16384, 8192, 8192
    f = 3 * 2.0 * m * n * k
    capable = Work(flops=f, gemms=((f, m, n, k, "n", False, True),), param_bytes=2 * n * k)
    kept = dataclasses.replace(capable, gemms=((f, m, n, k, "n", False, False),))
    bf16, auto = _ctx(), _ctx(float8="auto")
    assert auto.compute_time(capable, 1) < 0.75 * bf16.compute_time(capable, 1)
    assert auto.compute_time(kept, 1) == bf16.compute_time(kept, 1)
    gathered = auto.float8_gathered(capable, 1)
    assert gathered == n * k
    full, half = (ctx.fsdp_collectives(2 * n * k, 1, g)[0].nbytes for ctx, g in ((bf16, 0), (auto, gathered)))
    assert half == full // 2
    assert _ctx("a100_80gb", float8="auto").compute_time(capable, 1) == _ctx("a100_80gb").compute_time(capable, 1)
    with pytest.raises(ValueError, match="float8"):
        _ctx(float8="e5m2")
