"""The non-expert state sharded over dp x ep in the runtime, as the planner prices it: plans from
``plan_cluster`` with FSDP at dp 1 (FSDP over ep alone) and ZeRO-1 with ep (the non-expert
parameters' optimizer over the flattened dp x ep mesh, the experts' over dp:
``parallelisms.data.zero1_of``), one and two pipeline stages, applied on 4 gloo ranks: one SGD
step equals one device (loss rtol 1e-5; every parameter after the step rtol 1e-4 / atol 1e-6;
under FSDP every gradient too -- ZeRO-1 reduces gradients into its flat buffer, not into .grad)."""
import pytest

from autoplan import plan_cluster
from autoplan.verify import verify
from tests.planner import ep_plan_workers
from tests.runtime.ep_workers import build
from tests.search_pp.ep_workers import run_ep_pipeline


def _plan(name, **cons):
    model = build(name)[0].to("meta")
    model.config.use_cache = False
    return plan_cluster(model, 4, hardware="cpu", batch=(4 if cons.get("pp", 1) == 1 else 8, 8), devices_per_node=4,
                        constraints=dict(dict(tp=1, pp=1, microbatch_size=1, expert_parallel=True), **cons))


def test_one_stage_plans_equal_one_device_on_4_ranks(pool4):
    cases = [("fsdp/dp1xep4", _plan("mixtral", dp=1, ep=4, dp_mode="fsdp")),
             ("zero1/dp2xep2", _plan("mixtral", dp=2, ep=2, dp_mode="zero1")),
             ("zero1/dp1xep4", _plan("qwen3_moe", dp=1, ep=4, dp_mode="zero1"))]
    assert [p.fsdp.get("mode") for _, p in cases] == ["fsdp", "zero1", "zero1"]
    jobs = [(label, plan.to_json(), label.startswith("zero1/dp1") and "qwen3_moe" or "mixtral") for label, plan in cases]
    for rank, rep in enumerate(pool4.run(ep_plan_workers.run_all, jobs)):
        for label, *_ in jobs:
            r = rep[label]
            assert "error" not in r, (rank, label, r)
            assert abs(r["ref"] - r["par"]) <= 1e-5 * abs(r["ref"]), (rank, label, r)
            assert not r["bad_params"] and r["ep_sharded"] > 0 and r["local_rows"] == 1, (rank, label, r)
            if label.startswith("fsdp"):   # FSDP over ep: 1/4 of every non-expert weight, gradients averaged
                assert not r["bad_grads"], (rank, label, r)
                assert r["dense_shards"] and all(dims == ("dp_ep",) and rows == -(-full // 4) for dims, rows, full
                                                 in r["dense_shards"].values()), (rank, label, r["dense_shards"])


def test_zero1_over_ep_inside_a_pipeline_equals_one_device_on_4_ranks(pool4):
    plan = _plan("mixtral", dp=1, ep=2, pp=2, dp_mode="zero1", schedule="1F1B")
    assert plan.fsdp.get("mode") == "zero1"
    for rank, rep in enumerate(pool4.run(run_ep_pipeline, [(plan.to_json(), "mixtral")])):
        for label, r in rep.items():
            assert r["par"] == pytest.approx(r["ref"], rel=1e-5), (rank, label, r)
            assert not r["bad_params"] and r["experts_split"] > 0, (rank, label, r)


def test_deepseek_v3_and_qwen3_moe_state_over_ep_equal_one_device_on_4_ranks(pool4):
    """The same layouts on DeepSeek-V3's shape (latent attention, shared expert, a dense first
    layer, grouped routing) and on Qwen3-MoE, one stage and inside a two-stage pipeline."""
    cases = [("fsdp/dp1xep4", _plan("deepseek_v3", dp=1, ep=4, dp_mode="fsdp"), "deepseek_v3"),
             ("zero1/dp2xep2", _plan("deepseek_v3", dp=2, ep=2, dp_mode="zero1"), "deepseek_v3"),
             ("fsdp/dp2xep2", _plan("qwen3_moe", dp=2, ep=2, dp_mode="fsdp"), "qwen3_moe")]
    jobs = [(label, plan.to_json(), name) for label, plan, name in cases]
    for rank, rep in enumerate(pool4.run(ep_plan_workers.run_all, jobs)):
        for label, *_ in jobs:
            r = rep[label]
            assert "error" not in r, (rank, label, r)
            assert abs(r["ref"] - r["par"]) <= 1e-5 * abs(r["ref"]), (rank, label, r)
            assert not r["bad_params"] and r["ep_sharded"] > 0, (rank, label, r)
            if label.startswith("fsdp"):
                assert not r["bad_grads"], (rank, label, r)
    for name, mode in (("deepseek_v3", "fsdp"), ("qwen3_moe", "zero1")):
        plan = _plan(name, dp=1, ep=2, pp=2, dp_mode=mode, schedule="1F1B")
        assert plan.fsdp.get("mode") == mode and int(plan.pipeline["pp"]) == 2
        split = 0
        for rank, rep in enumerate(pool4.run(run_ep_pipeline, [(plan.to_json(), name)])):
            for label, r in rep.items():
                assert r["par"] == pytest.approx(r["ref"], rel=1e-5), (rank, name, mode, label, r)
                assert not r["bad_params"], (rank, name, mode, label, r)
                split += r["experts_split"]
        assert split > 0, (name, mode)   # (DeepSeek-V3's first layer is dense: stage 0 holds no experts)


def test_dry_run_names_a_shared_group_as_the_plan_does():
    """At dp 1 the flattened dp x ep mesh FSDP runs on is the ep group itself: verify attributes
    each collective to the dimension the plan predicts it on (the all-to-alls to ep, FSDP's gathers
    to dp_ep), and the dense gradients FSDP averaged are not all-reduced again over ep after the
    dry run materializes the model (its parameters are new objects then)."""
    plan = _plan("mixtral", dp=1, ep=4, dp_mode="fsdp")
    model = build("mixtral")[0].to("meta")
    model.config.use_cache = False
    result = verify(plan, model)
    assert result.passed, result.mismatches()
    dims = set(result.collectives["mesh_dim"])
    assert {"ep", "dp_ep"} <= dims, dims
