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


def test_70b_on_h100_takes_float8_for_every_block_linear_and_keeps_the_head():
    model = build_preset("titan-llama3-70b")
    section = choose_precision(_on("h100_sxm"), model)
    assert set(section["modules"]) == {f"layers.*.{m}" for m in ("attention.wq", "attention.wk", "attention.wv",
                                                                  "attention.wo", "feed_forward.w1",
                                                                  "feed_forward.w2", "feed_forward.w3")}
    assert "output" in section["kept"] and section["fsdp_float8_all_gather"]


def test_never_on_hardware_without_float8():
    model = build_preset("titan-llama3-70b")
    for hw in ("a100_80gb", "a100_40gb"):
        chosen, kept = choose_float8(_on(hw), model)
        assert chosen == {} and "no float8 GEMM" in kept["layers.0.attention.wq"]
        assert choose_precision(_on(hw), model) is None


def test_small_gemms_do_not_pay():
    cost = linear_cost(load_hardware("h100_sxm"), 2048, 512, 512)
    assert cost.saving_s < 0 < cost.cast_s
