"""Expert parallelism planned by autoplan (parallel.ep): MoE layers recognised, ExpertParallel
priced against replicated experts, the decision in the plan with its exact collectives; the dry
run (balanced routing) at world 64 issues exactly the predicted collectives; plans applied on 4
gloo ranks equal one device for one training step."""
import pytest
import torch

from autoplan import autoplan
from autoplan.errors import PlanSchemaError
from autoplan.mesh_plan import plan_mesh
from autoplan.parallelisms import parallelism
from autoplan.plan import Plan
from autoplan.request import PlanRequest
from autoplan.verify.dry_run import verify
from hyper_parallel import ExpertParallel, ParallelDims
from tests.planner import ep_plan_workers
from tests.runtime.ep_workers import VOCAB, build

BATCH = (4, 8)


def _plan(model, shape, names, hardware="cpu", batch=BATCH, **kw):
    request = PlanRequest.for_mesh("plan_mesh", hardware=hardware, batch=batch, dtype=torch.float32, **kw)
    return plan_mesh(model, ParallelDims(shape, names, hardware=hardware), request)


@pytest.fixture(scope="module")
def mixtral():
    return build("mixtral")[0]


@pytest.fixture(scope="module")
def qwen3():
    return build("qwen3_moe")[0]


@pytest.fixture(scope="module")
def dp_ep_plan(mixtral):
    return _plan(mixtral, (2, 2), ("dp", "ep"), expert_parallel=True)


def test_plan_records_the_expert_decision(mixtral, dp_ep_plan):
    plan = dp_ep_plan
    ep = plan.parallel["ep"]
    assert ep["dim"] == "ep" and ep["imbalance"] == 1.0
    assert ep["styles"] == {"model.layers.*.mlp.experts": ExpertParallel().to_dict()}
    rows = plan.predictions["collectives"]
    a2a = [r for r in rows if r["kind"] == "all_to_all"]
    # per layer: counts + dispatch + combine forward, two backward; 2 layers
    assert sum(r["count"] for r in a2a) == 10 and {r["mesh_dim"] for r in a2a} == {"ep"}
    tokens = BATCH[0] // 4 * BATCH[1]
    assert {r["bytes"] for r in a2a} == {8 * 8, tokens * 2 * 32 * 4}
    # FSDP: the non-expert parameters over the flattened dp x ep mesh (no all-reduce over ep), the experts over dp
    assert not any(r["kind"] == "all_reduce" and r["mesh_dim"] == "ep" for r in rows)
    assert {r["kind"] for r in rows if r["mesh_dim"] == "dp_ep"} == {"all_gather", "reduce_scatter"}
    assert {r["kind"] for r in rows if r["mesh_dim"] == "dp"} == {"all_gather", "reduce_scatter"}
    assert any("routing imbalance factor 1" in n for n in plan.notes)
    expert_rows = [d for d in plan.decisions if d["unit"].endswith("/experts")]
    assert [d["strategy"] for d in expert_rows] == ["expert_parallel"]
    assert {o["strategy"] for o in expert_rows[0]["options"]} == {"replicated", "expert_parallel"}
    back = Plan.from_json(plan.to_json())
    assert back.parallel == plan.parallel
    # the priced choice on a tiny model: latency-bound all-to-alls lose to one all-reduce
    free = autoplan(mixtral, ParallelDims((2, 2), ("dp", "ep"), hardware="cpu"), batch=BATCH)
    assert free.parallel["ep"]["styles"] == {} and free.parallel["ep"]["dim"] == "ep"


def test_dense_and_moe_layers_get_different_strategies_and_verify_at_world_64():
    """A Mixtral shape wide enough for tensor parallelism to pay: attention sharded over tp by
    the TP search, experts split over ep with expert TP; the dry run at 64 ranks issues exactly
    the predicted collectives (all-to-alls on ep, expert and attention all-reduces on tp, FSDP on dp)."""
    import transformers as tf

    cfg = tf.MixtralConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=2, num_attention_heads=16,
                           num_key_value_heads=8, intermediate_size=8192, num_local_experts=8, num_experts_per_tok=2)
    with torch.device("meta"):
        model = tf.MixtralForCausalLM(cfg)
    plan = plan_mesh(model, ParallelDims((8, 4, 2), ("dp", "ep", "tp"), hardware="h100_sxm"),
                     PlanRequest.for_mesh("plan_mesh", hardware="h100_sxm", batch=(64, 1024), expert_parallel=True))
    strategies = {d["unit"]: d["strategy"] for d in plan.decisions}
    assert strategies["model.layers.*.mlp.experts/experts"] == "expert_parallel_tp", strategies
    assert strategies["model.layers/attention"] not in ("replicate", "replicated"), strategies
    assert "model.layers.*.self_attn" in plan.styles or any("self_attn" in k for k in plan.styles), plan.styles
    assert plan.parallel["ep"]["styles"]["model.layers.*.mlp.experts"]["args"] == {"tp_dim": "tp"}
    result = verify(plan, model)
    assert result.passed, (result.error, result.mismatches())
    assert {"tp", "ep", "dp"} <= set(result.collectives["parallelism"])


def test_section_checks(dp_ep_plan):
    plan = dp_ep_plan
    data = plan.to_dict()
    bad = {**data, "parallel": {**data["parallel"], "ep": None}}
    with pytest.raises(PlanSchemaError, match="parallel/ep"):
        Plan.from_dict(bad)
    style = {"style": "ExpertParallel", "args": {"ep_dim": "ep", "split_tokens": True}}
    bad = {**data, "parallel": {**data["parallel"], "ep": {**data["parallel"]["ep"],
                                                           "styles": {"model.layers.*.mlp.experts": style}}}}
    with pytest.raises(PlanSchemaError, match="split_tokens"):
        Plan.from_dict(bad)
    assert parallelism("ep").traffic_dims(plan) == ("ep",)


@pytest.mark.parametrize("name,ac", [("mixtral", False), ("qwen3", False), ("mixtral", True)])
def test_dry_run_matches_at_world_64(name, ac, mixtral, qwen3):
    """With full recomputation the all-to-alls run again in backward (predicted so)."""
    model = {"mixtral": mixtral, "qwen3": qwen3}[name]
    model.config.use_cache = False   # a KV cache grows again under recomputation; training never reads it
    plan = _plan(model, (8, 4, 2), ("dp", "ep", "tp"), hardware="h100_sxm", batch=(64, 16), expert_parallel=True,
                 activation_checkpointing=ac)
    assert plan.parallel["ep"]["styles"] and plan.activation_checkpointing == ac
    result = verify(plan, model)
    assert result.passed, (result.error, result.mismatches())
    assert set(result.collectives["parallelism"]) >= {"ep", "dp"}
    assert (result.collectives["kind"] == "all_to_all").any()


@pytest.mark.parametrize("name,shape", [("mixtral", (2, 2)), ("qwen3", (2, 4))])
def test_fsdp_over_dp_x_ep_dry_runs_as_predicted(name, shape, mixtral, qwen3):
    """FSDP on a (dp, ep) mesh: every non-expert parameter sharded over the dp x ep ranks (one
    all-gather / reduce-scatter per unit on the flattened ``dp_ep`` mesh), the experts over dp,
    no all-reduce over ep; issued exactly as predicted, parameter bytes included."""
    model = {"mixtral": mixtral, "qwen3": qwen3}[name]
    plan = _plan(model, shape, ("dp", "ep"), batch=(16, 8), expert_parallel=True)
    assert plan.fsdp["enabled"] and plan.parallel["ep"]["styles"]
    result = verify(plan, model)
    assert result.passed, (result.error, result.mismatches())
    df = result.collectives
    assert set(df[df["mesh_dim"] == "dp_ep"]["kind"]) == {"all_gather", "reduce_scatter"}, df.to_string()
    assert set(df[df["mesh_dim"] == "ep"]["kind"]) == {"all_to_all"}, df.to_string()
    # every tensor of these models divides evenly: the non-expert ones 1 / (dp x ep) each, the experts
    # 1 / ep (ExpertParallel) then 1 / dp (FSDP); so each rank holds 1 / (dp x ep) of the fp32 model
    total = sum(p.numel() for p in model.parameters())
    assert result.param_bytes["issued"] == plan.predictions["memory_bytes"]["params"] == 4 * total // (
        shape[0] * shape[1]), result.param_bytes


def test_plans_equal_one_device_on_4_ranks(pool4, mixtral, dp_ep_plan):
    """HF Mixtral and the repo MoE model (dense first layer, shared expert, 3-D experts)."""
    repo = build("repo")[0]
    ep_tp = _plan(mixtral, (2, 2), ("ep", "tp"), expert_parallel=True)
    free = _plan(mixtral, (2, 2), ("dp", "ep"), expert_parallel=False)   # ep as data parallel, experts replicated
    repo_dp_ep = _plan(repo, (2, 2), ("dp", "ep"), expert_parallel=True)
    repo_ep_tp = _plan(repo, (2, 2), ("ep", "tp"), expert_parallel=True)
    assert ep_tp.parallel["ep"]["styles"] and not free.parallel["ep"]["styles"]
    assert repo_dp_ep.parallel["ep"]["styles"] == {"layers.1.feed_forward.experts": ExpertParallel().to_dict()}
    cases = [("dpxep", dp_ep_plan.to_json(), "mixtral"), ("epxtp", ep_tp.to_json(), "mixtral"),
             ("dpxep/replicated", free.to_json(), "mixtral"), ("dpxep/repo", repo_dp_ep.to_json(), "repo"),
             ("epxtp/repo", repo_ep_tp.to_json(), "repo")]
    reports = pool4.run(ep_plan_workers.run_all, cases)
    for rank, rep in enumerate(reports):
        for label, *_ in cases:
            r = rep[label]
            assert "error" not in r, (rank, label, r)
            assert abs(r["ref"] - r["par"]) <= 1e-5 * abs(r["ref"]), (rank, label, r)
            assert not r["bad_grads"] and not r["bad_params"], (rank, label, r)
            assert r["local_rows"] == (1 if label.startswith("dp") else 2), (rank, label, r)
            assert (r["ep_sharded"] > 0) == (not label.endswith("replicated")), (rank, label, r)
            if label.startswith("dp"):   # FSDP over the flattened dp x ep mesh: 1/4 of every non-expert weight
                dense = r["dense_shards"]
                assert dense and all(dims == ("dp_ep",) and rows == -(-full // 4) for dims, rows, full in
                                     dense.values()), (rank, label, dense)
                assert dense["tok_embeddings.weight" if "repo" in label else "model.embed_tokens.weight"][1] == VOCAB // 4


def test_dcp_checkpoint_of_an_fsdp_dp_x_ep_plan_resumes_exactly(pool4, dp_ep_plan, tmp_path):
    """Parameters and AdamW state sharded over dp x ep (and the experts over ep x dp) save with
    DCP and load into a fresh runner of the same plan: the resumed step equals the uninterrupted one."""
    assert dp_ep_plan.fsdp["enabled"]
    for rank, r in enumerate(pool4.run(ep_plan_workers.save_and_resume, dp_ep_plan.to_json(), "mixtral",
                                       str(tmp_path / "ckpt"))):
        assert r["step"] == 1 and r["n"] > 10 and not r["differ"], (rank, r)
        assert r["loss"] == r["resumed_loss"], (rank, r)


def test_repo_moe_layer_is_captured_with_routed_flops():
    """The repo model's experts (autoplan::expert_mm) are traced: an MoE layer with top-k routed
    GEMM FLOPs (2 x rows x in x out per projection, rows = tokens x top_k), forward and backward."""
    from autoplan.capture import capture
    from autoplan.search.units.work import module_work

    graph = capture(build("repo")[0], None, batch=(2, 8), dtype=torch.float32)
    moe = [e for b in graph.blocks for e in (b.roles or {}).get("moe", [])]
    assert [m["experts"] for m in moe] == ["feed_forward.experts"] and moe[0]["top_k"] == 2
    rows, h, f = 2 * 8 * 2, 32, 16
    gemm = 2 * rows * h * 2 * f + 2 * rows * f * h
    assert module_work(graph, "layers.1.feed_forward.experts").flops >= 3 * gemm


def test_kimi_k2_layout_plans_and_dry_runs_at_world_64():
    """Kimi K2's expert layout (DeepSeek-V3 architecture, 384 routed experts, top-8, 4,096 tokens
    = 32,768 routed copies per rank, which 384 does not divide) on dp=4 x ep=16: ExpertParallel is
    planned (24 experts per rank, uneven all-to-all rows under balanced routing) and the dry run at
    world 64 issues exactly the predicted collectives. Widths shrunk (hidden 256) to keep it quick;
    the full widths plan and verify the same way (docs/expert_parallel.md)."""
    import transformers as tf

    cfg = tf.DeepseekV3Config(vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=384,
                              n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1,
                              first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16,
                              qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=4096, use_cache=False)
    with torch.device("meta"):
        model = tf.DeepseekV3ForCausalLM(cfg)
    plan = _plan(model, (4, 16), ("dp", "ep"), hardware="h100_sxm", batch=(64, 4096), expert_parallel=True)
    assert plan.parallel["ep"]["styles"] == {"model.layers.1.mlp.experts": ExpertParallel().to_dict()}
    a2a = sorted({r["bytes"] for r in plan.predictions["collectives"] if r["kind"] == "all_to_all"})
    copies = 4096 * 8
    # 32,768 = 85 x 384 + 128: the first 128 experts get 86 copies from every rank, so rank 0's 24 experts
    # receive 16 x 24 x 86 rows (sent back by combine) while it dispatches 32,768
    received = 16 * 24 * (copies // 384 + 1)
    assert a2a == [384 * 8, copies * 256 * 4, received * 256 * 4], a2a
    result = verify(plan, model)
    assert result.passed, (result.error, result.mismatches())



@pytest.mark.parametrize("rank,empty", [(0, False), (3, True)])
def test_a_rank_without_experts_leaves_them_out_of_fsdp(rank, empty):
    """6 experts over ep=4 are held 2, 2, 2, 0: rank 3's expert shards are empty, which FSDP2's
    reduce-scatter rejects, so they are left out of FSDP there (averaged over dp by the runner;
    the numerics with FSDP over dp=2 x ep=4: benchmarks/ep_numerics.py)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_parallel import parallelize_module
    from hyper_parallel.core.dtensor import fsdp_unshardable
    from hyper_parallel.local import fake_world

    with torch.device("meta"):
        model = build("mixtral", n_experts=6)[0].to("meta")
    with fake_world(4, rank=rank):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        parallelize_module(model, mesh, {"model.layers.*.mlp.experts": ExpertParallel()}, strict=True)
        left_out = {n for n, p in model.named_parameters() if any(p is q for q in fsdp_unshardable(model))}
    experts = {n for n, _ in model.named_parameters() if ".experts." in n}
    assert left_out == (experts if empty else set()), left_out
