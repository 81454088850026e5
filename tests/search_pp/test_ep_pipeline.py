"""Expert parallel inside a pipeline (ep x pp): plan_cluster offers it (its search enumerates ep with
pp: tests/planner/test_cluster_ep_cp.py), plan.apply runs it -- each
micro-batch's rows sharded over ep inside every stage, the experts split over ep, non-expert
gradients averaged over dp x ep and expert gradients over dp -- and one SGD step equals one device
(loss rtol 1e-5, every gradient and parameter rtol 1e-4 / atol 1e-6) for HF Mixtral and Qwen3-MoE
on 4 and 8 gloo ranks; verify's pipeline dry run issues exactly the predicted collectives of every
pipeline rank at world 64 (all-to-alls per MoE layer and micro-batch, FSDP of the ep-sharded experts
over dp and of everything else over the flattened dp x ep mesh -- no all-reduce over ep)."""
import pytest

from autoplan import plan_cluster
from autoplan.verify.dry_run import verify
from tests.runtime.ep_workers import build
from tests.search_pp.ep_workers import run_ep_pipeline

SEQ = 8


def _plan(name: str, world: int, cons: dict, batch: int = 8):
    model = build(name)[0].to("meta")
    model.tie_weights()   # moving to meta unties a tied head
    model.config.use_cache = False   # a KV cache grows again under recomputation; training never reads it
    plan = plan_cluster(model, world, hardware="cpu", batch=(batch, SEQ), devices_per_node=world,
                        constraints=dict(cons, fsdp=True, expert_parallel=True, microbatch_size=1))
    mesh = dict(zip(plan.mesh["names"], plan.mesh["shape"]))
    assert mesh["ep"] == cons["ep"] and mesh["pp"] == cons["pp"] and plan.parallel["ep"]["styles"], plan.mesh
    return plan, model


def _check(reports, n_shards):
    for rank, rep in enumerate(reports):
        for label, r in rep.items():
            assert r["n_params"] > 0 and r["experts_split"] > 0, (rank, label, r)
            assert r["par"] == pytest.approx(r["ref"], rel=1e-5), (rank, label, r)
            assert not r["bad_grads"] and not r["bad_params"], (rank, label, r)
            assert r["local_rows"] == 8 // n_shards, (rank, label, r)


def test_ep2_pp2_mixtral_equals_one_device_on_4_ranks(pool4):
    plan, _ = _plan("mixtral", 4, {"dp": 1, "ep": 2, "pp": 2, "tp": 1})
    _check(pool4.run(run_ep_pipeline, [(plan.to_json(), "mixtral")]), 2)


def test_dp2_ep2_pp2_qwen3_moe_equals_one_device_on_8_ranks(pool8):
    """FSDP over dp on top: the ep-sharded experts are FSDP-sharded over dp too."""
    plan, _ = _plan("qwen3_moe", 8, {"dp": 2, "ep": 2, "pp": 2, "tp": 1})
    assert plan.fsdp["enabled"]
    _check(pool8.run(run_ep_pipeline, [(plan.to_json(), "qwen3_moe")]), 4)


@pytest.mark.parametrize("name,cons", [
    ("mixtral", {"schedule": "1F1B", "activation_checkpointing": True}),   # the all-to-alls recomputed
    ("qwen3_moe", {"schedule": "ZBV"}),                                    # split backward: run twice
])
def test_every_pipeline_rank_matches_predictions_at_world_64(name, cons):
    plan, model = _plan(name, 64, dict(cons, dp=4, ep=4, pp=2, tp=2), batch=32)
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches().to_string())
    df = res.collectives
    ep_rows = df[(df["mesh_dim"] == "ep") & (df["issued"] > 0)]
    assert set(ep_rows["kind"]) == {"all_to_all"}, df.to_string()
    assert set(df[df["mesh_dim"] == "dp_ep"]["kind"]) == {"all_gather", "reduce_scatter"}, df.to_string()
    assert sorted(df["pp_rank"].unique()) == [0, 1]


def test_an_lm_head_tied_across_stages_is_averaged_over_ep_as_predicted(pool4):
    """The embedding and its tied head on two stages: FSDP leaves both copies out, so each
    holder's stage averages its copy over ep after backward (ExpertGradSync) -- equal to one
    device on gloo, and the pipeline dry run at world 64 predicts that all-reduce on both pp ranks."""
    plan, _ = _plan("qwen3_moe_tied", 4, {"dp": 1, "ep": 2, "pp": 2, "tp": 1})
    _check(pool4.run(run_ep_pipeline, [(plan.to_json(), "qwen3_moe_tied")]), 2)
    plan, model = _plan("qwen3_moe_tied", 64, {"dp": 4, "ep": 4, "pp": 2, "tp": 2, "schedule": "1F1B"}, batch=32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches().to_string())
    df = res.collectives
    sync = df[(df["mesh_dim"] == "ep") & (df["kind"] == "all_reduce")]
    assert sorted(sync["pp_rank"]) == [0, 1] and (sync["predicted"] == 1).all(), df.to_string()


def test_without_ep_the_experts_are_split_over_tp_in_every_stage_and_verify_exactly():
    """A mesh with tp and no ep: plan_cluster's TP solution has the experts as units (each expert
    split on its ffn width), replicated units forbidden; the pipeline dry run at world 64 issues
    exactly the predicted collectives (the experts' all-reduces over tp among them)."""
    model = build("qwen3_moe")[0].to("meta")
    model.config.use_cache = False
    plan = plan_cluster(model, 64, hardware="h100_sxm", batch=(32, SEQ), devices_per_node=64,
                        constraints=dict(dp=16, pp=2, tp=2, ep=1, schedule="ZBV", fsdp=True, microbatch_size=1),
                        allow_replicated_units=False)
    picked = {d["unit"]: d["strategy"] for d in plan.decisions}
    assert picked["model.layers/moe"] == "experts_tp", picked
    assert plan.styles["model.layers.*.mlp.experts"]["style"] == "ExpertParallel"
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches().to_string())
