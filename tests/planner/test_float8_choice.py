"""The planner's per-module precision: float8 for Llama-3-70B's block Linears on H100 where it is
cheaper, never on hardware without a float8 GEMM; small GEMMs where casts cost more stay bf16."""
from autoplan.plan import Plan
from autoplan.precision.choose import choose_float8, choose_precision
from autoplan.presets import build_preset
from cost_models.hardware import load_hardware
from cost_models.precision import linear_cost

PLAN = "benchmarks/results/planning_cold_plans/70b-512.json"   # dp 64 x pp 2 x tp 4 on H100, 512 x 8192 tokens


def _on(hardware):
    plan = Plan.from_json(PLAN)
    return plan.replace(mesh=dict(plan.mesh, hardware=hardware))


def test_70b_on_h100_takes_float8_where_it_pays_and_keeps_the_head():
    """dp 64 x pp 2 x tp 4: 64K tokens a rank. q, o and the MLP take float8; k and v (N = 1024 / 4 = 256
    a rank) do not: their six casts cost more than the faster GEMM saves."""
    model = build_preset("llama3-70b")
    section = choose_precision(_on("h100_sxm"), model)
    assert set(section["modules"]) == {f"model.layers.*.{m}" for m in (
        "self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert "does not pay" in section["kept"]["model.layers.*.self_attn.k_proj"]
    assert "lm_head" in section["kept"] and section["fsdp_float8_all_gather"]


def test_never_on_hardware_without_float8():
    model = build_preset("llama3-70b")
    for hw in ("a100_80gb", "a100_40gb"):
        chosen, kept = choose_float8(_on(hw), model)
        assert chosen == {} and "no float8 GEMM" in kept["model.layers.0.self_attn.q_proj"]
        assert choose_precision(_on(hw), model) is None


def test_small_gemms_do_not_pay():
    cost = linear_cost(load_hardware("h100_sxm"), 2048, 512, 512)
    assert cost.saving_s < 0 < cost.cast_s


def test_explain_says_each_modules_precision():
    model = build_preset("llama3-70b")
    plan = _on("h100_sxm")
    plan = plan.replace(parallel={**plan.parallel, "precision": choose_precision(plan, model)})
    text = str(plan.explain("model.layers/attention").notes)
    assert "model.layers.*.self_attn.q_proj in float8 (tensorwise)" in text
    assert "lm_head kept in high precision" in str(plan.explain("head").notes)
