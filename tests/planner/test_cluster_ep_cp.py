"""Context (cp) and expert (ep) parallelism inside the cluster search (``plan_cluster`` /
``autoplan(model, N)``): which degrees the search tries, what it prices, and plans at world 64
that verify exactly in the dry run (fake process group)."""
import dataclasses
import math

import pytest
import torch

from autoplan import autoplan, plan_cluster
from autoplan.capture import capture
from autoplan.errors import InfeasiblePlanError, InvalidConstraintError
from autoplan.search.mesh.dims import CP_MIN_SEQ, cp_degrees
from autoplan.search.experts.search import (
    DEEPEP_RUNTIME, OUR_EXPERT_RUNTIME, ExpertRuntime, _pattern, grouped_expert_time, moe_groups,
)
from autoplan.models import build_llama
from autoplan.presets import build_preset
from autoplan.search.mesh.candidates import mesh_factorizations
from autoplan.search.mesh.search import ClusterSearch
from autoplan.verify.dry_run import verify
from tests.planner.models import repo_llama_8b
from tests.runtime.ep_workers import build
from tests.search_pp.workers import build as build_pp, run_pipeline_case


@pytest.fixture(scope="module")
def mixtral():
    model = build("mixtral")[0]
    model.config.use_cache = False
    return model


@pytest.fixture(scope="module")
def mixtral_8x7b():
    """Mixtral-8x7B's shape, 2 layers (one repeated block group), on meta."""
    model = build_preset("mixtral-8x7b", num_layers=2)
    model.config.use_cache = False
    return model


def _llama_8b(layers: int, seq: int):
    return build_llama(device="meta", dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, vocab_size=128256,
                       ffn_hidden=14336, max_seq_len=seq)


def test_dense_short_sequences_search_only_dp_pp_tp():
    """Below CP_MIN_SEQ tokens and without MoE layers the search is the dp x pp x tp one it was:
    every mesh has cp = ep = 1 (plans on them: tests/search_pp); from CP_MIN_SEQ on, cp is tried."""
    model = repo_llama_8b(2)
    search = ClusterSearch.of(model, 16, hardware="h100_sxm", batch=(16, 4096), microbatch_sizes=(1,))
    meshes = search.meshes()
    assert meshes and all(cp == 1 and ep == 1 for *_, cp, ep in meshes)
    assert {(dp, pp, tp) for dp, pp, tp, _, _ in meshes} == set(mesh_factorizations(16, 8, len(search.unit_names)))
    assert cp_degrees(model, 4096, 16, {}) == [1]
    assert cp_degrees(model, CP_MIN_SEQ, 16, {}) == [1, 2, 4, 8]     # chunks of >= 4096 tokens
    assert cp_degrees(model, 4096, 16, {"cp": 2}) == [2]


def test_long_sequence_plan_chooses_cp_fits_and_verifies_at_world_64():
    """64 H100s, 8 sequences of 64K tokens: the cluster search prices cp (one sequence per
    micro-batch), picks cp > 1, fits memory, and the plan dry-runs exactly at world 64."""
    seq = 65536
    model = _llama_8b(2, seq)
    plan = autoplan(model, 64, batch=(8, seq), hardware="h100_sxm", constraints={"microbatches": 1})
    mesh = dict(zip(plan.mesh["names"], plan.mesh["shape"]))
    assert math.prod(plan.mesh["shape"]) == 64 and mesh.get("cp", 1) > 1, mesh
    assert plan.parallel["cp"]["degree"] == mesh["cp"]
    assert plan.predictions["memory_bytes"]["total"] <= 80 * 2**30
    assert any(a["mesh"].get("cp", 1) == 1 for a in plan.alternatives) or len(plan.alternatives) >= 1
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches().to_string())
    assert set(res.collectives[res.collectives["mesh_dim"] == "cp"]["kind"]) <= {"send_recv", "all_gather",
                                                                                   "reduce_scatter"}


def test_moe_search_tries_ep_and_a_plan_with_ep_verifies_at_world_64(mixtral, mixtral_8x7b):
    """A MoE model: the search enumerates ep (borrowed from dp, with and without a pipeline) beside dp x pp x tp;
    Mixtral-8x7B's layer shape (2 layers) with ep fixed at 8 on 64 H100s plans ExpertParallel with
    expert TP and dry-runs exactly (balanced routing; bf16 with FSDP mixed precision: the ep
    gradient all-reduce in fp32)."""
    search = ClusterSearch.of(mixtral, 64, hardware="h100_sxm", batch=(64, 16), dtype=torch.float32)
    meshes = search.meshes()
    eps = {ep for *_, ep in meshes}
    assert {1, 2, 4, 8} <= eps and any(pp > 1 for _, pp, _, _, ep in meshes if ep > 1)
    model = mixtral_8x7b
    plan = plan_cluster(model, 64, batch=(64, 1024), hardware="h100_sxm",
                        constraints={"ep": 8, "pp": 1, "microbatches": 1})
    mesh = dict(zip(plan.mesh["names"], plan.mesh["shape"]))
    assert mesh["ep"] == 8 and plan.parallel["ep"]["dim"] == "ep" and plan.parallel["ep"]["styles"], mesh
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches().to_string())
    assert "all_to_all" in set(res.collectives[res.collectives["mesh_dim"] == "ep"]["kind"])
    # our runtime neither overlaps nor de-duplicates the all-to-alls, and the plan says it priced them so
    assert any("not overlapped with compute" in n for n in plan.notes), plan.notes


def test_ep_priced_in_the_step_and_with_a_pipeline(mixtral_8x7b):
    """ep changes the per-unit price (all-to-alls in forward, expert state / ep) and ``evaluate``
    prices ep with a pipeline (a published layout)."""
    search = ClusterSearch.of(mixtral_8x7b, 64, hardware="h100_sxm", batch=(64, 1024), microbatch_sizes=(1,))
    dense, _ = search.unit_costs(8, 1, 1, "replicate", "none", 1)      # 8 data-parallel replicas
    ep8, _ = search.unit_costs(8, 1, 1, "replicate", "none", 1, ep=8)  # the same x ep8: experts / 8
    assert sum(u.state_bytes for u in ep8) < sum(u.state_bytes for u in dense)
    # ep8 changes the forward by the experts' compute (one local expert's weights read instead of
    # eight: grouped_expert_time) plus the forward all-to-alls, which must be priced (> 0)
    ctx = search.ctx(8, 1, 1, "replicate", "none", 1, 8)
    g = search.moe_groups[0]
    kw = dict(tokens=1024, dtype_bytes=search.structure(1).dtype_bytes, etp=1)
    compute_change = (grouped_expert_time(ctx, g, ep=8, **kw) - grouped_expert_time(ctx, g, ep=1, **kw)) * g.count / 3
    a2a_forward = sum(u.forward for u in ep8) - sum(u.forward for u in dense) - compute_change
    assert a2a_forward > 0
    # a runtime that hides the all-to-alls behind the other micro-batch (DualPipe: ExpertRuntime overlap 1)
    # leaves only the compute change in the forward
    hidden = ClusterSearch.of(mixtral_8x7b, 64, hardware="h100_sxm", batch=(64, 1024), microbatch_sizes=(1,),
                           graphs=search.graphs, expert_runtime=ExpertRuntime(overlap=1.0, source="test"))
    ep8_hidden, _ = hidden.unit_costs(8, 1, 1, "replicate", "none", 1, ep=8)
    assert sum(u.forward for u in ep8_hidden) == pytest.approx(sum(u.forward for u in dense) + compute_change)
    # FSDP: a pipeline's re-gather of a MoE block (UnitCost.dp_gather_s) moves the experts' ep shard,
    # not the whole layer (mesh.dims.add_ep scales it with the reductions and the optimizer step)
    f_ep8, _ = search.unit_costs(8, 1, 1, "fsdp", "none", 1, ep=8)
    ctx8 = search.ctx(8, 1, 1, "fsdp", "none", 1, 8)
    whole_layers = g.count * ctx8.comm_time(ctx8.fsdp_collectives(g.param_bytes, 1)[:1], latency=False)
    assert sum(u.dp_gather_s for u in f_ep8) < 0.5 * whole_layers
    cand = search.evaluate(dict(dp=4, pp=2, tp=1, ep=8), "1F1B", 1, "fsdp", "none")
    assert cand.step_s > 0 and cand.mesh == {"dp": 4, "ep": 8, "pp": 2, "tp": 1}


def test_deepseek_v3_moe_capture_finds_routed_experts_and_top_k():
    """DeepSeek-V3 (first layer dense, group-limited routing): the MoE group is the routed
    experts (not the shared expert), top_k is the final top-k, one pattern for all MoE layers,
    and a transposed expert weight is not saved as an activation."""
    model = build("deepseek_v3")[0]
    graph = capture(model, None, batch=(1, 8), dtype=torch.float32)
    groups = moe_groups(graph, model, 4)
    assert [g.rel for g in groups] == ["mlp.experts"]          # the routed experts, not mlp.shared_experts
    # MoE layers after dense ones: one pattern when no other layer has the experts module
    assert _pattern("model.layers", ["3", "4"], 5, "mlp.experts", others_have=False) == ["model.layers.*.mlp.experts"]
    assert _pattern("model.layers", ["3", "4"], 5, "mlp.experts") == ["model.layers.3.mlp.experts",
                                                                      "model.layers.4.mlp.experts"]
    assert groups[0].top_k == model.config.num_experts_per_tok
    moe_block = next(b for b in graph.blocks if (b.roles or {}).get("moe"))
    saved = [n for n in graph.nodes if n.block == moe_block.id and n.module.endswith("mlp.experts")
             and n.op == "aten.transpose.int" and n.saved_for_backward]
    assert not saved


def test_cp_and_ep_constraints_are_checked():
    model = repo_llama_8b(2)
    with pytest.raises(InvalidConstraintError, match="2\\*cp"):
        plan_cluster(model, 8, batch=(8, 4100), constraints={"cp": 4})
    with pytest.raises(InvalidConstraintError, match="not both"):
        plan_cluster(model, 8, batch=(8, 4096), constraints={"cp": 2, "ep": 2})


def test_cp_with_pp_plan_verifies_on_every_pipeline_rank_at_world_64():
    """cp inside a pipeline: plan_cluster with cp=2, pp=2 on 64 devices writes each pipeline rank's
    exact rows (its blocks' ring exchange per micro-batch, the loss's all-reduce on the last stage,
    FSDP over dp x cp) and the dry run of every pipeline rank issues exactly those."""
    model = build_llama(device="meta", dim=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_hidden=512,
                        max_seq_len=1024)
    plan = autoplan(model, 64, batch=(16, 1024), hardware="cpu", dtype=torch.float32,
                    constraints={"cp": 2, "pp": 2, "schedule": "1F1B"})
    mesh = dict(zip(plan.mesh["names"], plan.mesh["shape"]))
    assert mesh["cp"] == 2 and mesh["pp"] == 2 and plan.parallel["cp"]["degree"] == 2, mesh
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches().to_string())
    cp_rows = res.collectives[res.collectives["mesh_dim"] == "cp"]
    assert set(cp_rows["pp_rank"]) == {0, 1} and (cp_rows["issued"] > 0).all()
    loss = res.collectives[(res.collectives["kind"] == "all_reduce") & (res.collectives["bytes"] == 16)]
    assert list(loss["pp_rank"]) == [1]   # cp_cross_entropy on the last stage only


@pytest.mark.parametrize("schedule", ["1F1B", "ZBV"])
def test_cp_with_pp_plan_equals_one_device(pool4, schedule):
    """pp=2 x cp=2 on 4 gloo ranks, planned by plan_cluster and applied by the pipeline runner
    (sequences sharded head+tail, positions passed to every stage, cp_cross_entropy, FSDP over
    dp x cp; ZBV: split backward, two stages per rank): loss and every gradient and SGD-updated
    parameter equal one device."""
    plan = plan_cluster(build_pp("llama", device="meta"), 4, hardware="cpu", batch=(8, 16), devices_per_node=4,
                        constraints={"pp": 2, "cp": 2, "tp": 1, "dp": 1, "fsdp": True, "schedule": schedule})
    assert plan.parallel["cp"]["degree"] == 2 and plan.pipeline["pp"] == 2 and plan.pipeline["schedule"] == schedule
    assert plan.fsdp["mode"] == "fsdp"
    for r in pool4.run(run_pipeline_case, plan.to_json(), "llama", 8, 16):
        assert r["n_params"] > 0, r
        assert r["par"] == pytest.approx(r["ref"], rel=1e-5), r
        assert not r["bad_grads"] and not r["bad_params"], r


def test_shard_all_with_ep_splits_the_experts_by_expert_parallelism(mixtral):
    """allow_replicated_units=False (``autoplan train --shard-all``) on a mesh with ep: the MoE
    layers are no TP unit there but are sharded -- by ExpertParallel, which the expert plan is then
    held to -- so the plan is made (it was refused: "cannot be tensor-parallel ... planned by expert
    parallelism"), and verifies exactly; with expert_parallel=False asked, replicated experts are
    the replicated units forbidden: refused, naming the layer."""
    model = build("mixtral")[0].to("meta")
    model.config.use_cache = False
    for plan in (plan_cluster(model, 4, hardware="cpu", batch=(8, 16), devices_per_node=4,
                              constraints={"ep": 2, "tp": 2}, allow_replicated_units=False),
                 autoplan(model, {"shape": [2, 2], "names": ["ep", "tp"]}, hardware="cpu", batch=(8, 16),
                          allow_replicated_units=False)):
        assert list(plan.parallel["ep"]["styles"]) == ["model.layers.*.mlp.experts"], plan.parallel["ep"]
        assert plan.styles, plan
        res = verify(plan, model)
        assert res.passed, (res.error, res.mismatches().to_string())
    with pytest.raises(InfeasiblePlanError, match="mlp: cannot be tensor-parallel"):
        plan_cluster(model, 4, hardware="cpu", batch=(8, 16), devices_per_node=4,
                     constraints={"ep": 2, "tp": 2, "expert_parallel": False}, allow_replicated_units=False)


def test_routing_glue_prices_the_passes_the_runtime_makes(mixtral_8x7b):
    """The experts' routing glue by what the runtime does with the routed rows: ours re-sorts the
    received rows by local expert and back around the all-to-alls (dispatch's regroup / ungroup) and
    scales the returned rows in a pass of its own; DeepEP / TE's fused unpermute does neither."""
    search = ClusterSearch.of(mixtral_8x7b, 64, hardware="h100_sxm", batch=(64, 1024), microbatch_sizes=(1,))
    ctx = search.ctx(8, 1, 1, "replicate", "none", 1, 8)
    g = search.moe_groups[0]
    kw = dict(tokens=1024, dtype_bytes=2, etp=1)
    lean = ExpertRuntime(regroup=False, weights_apart=False, source="test")
    hw = ctx.hardware
    row = 1024 * g.top_k * g.layout.hidden * 2 * 3 / (hw.memory_bandwidth * hw.efficiency.memory)   # fwd + bwd

    def extra(ep):
        return grouped_expert_time(ctx, g, ep=ep, **kw) - grouped_expert_time(ctx, g, ep=ep, runtime=lean, **kw)
    assert extra(8) == pytest.approx(6 * row)   # regroup and ungroup (a read and a write each), the weights' pass
    assert extra(1) == pytest.approx(2 * row)   # no all-to-all, nothing to regroup
    assert DEEPEP_RUNTIME.regroup is False and DEEPEP_RUNTIME.weights_apart is False


def test_fsdp_over_ep_alone_prices_fsdp_traffic_every_micro_batch(mixtral_8x7b):
    """At dp 1 FSDP shards the non-expert state over ep -- ours (fully_shard over the flattened
    dp x ep mesh, parallelisms.data.state_mesh) as AutoModel's "FSDP 64" at ep 64 -- and gathers and
    reduce-scatters each unit over ep, which a single stage pays every micro-batch; with replicated
    dp ours keeps those weights whole on every ep rank and all-reduces their gradients once after
    backward."""
    ours = ClusterSearch.of(mixtral_8x7b, 8, hardware="h100_sxm", batch=(32, 1024), microbatch_sizes=(1,))
    whole, _ = ours.unit_costs(1, 1, 1, "replicate", "none", 1, ep=8)
    fsdp, _ = ours.unit_costs(1, 1, 1, "fsdp", "none", 1, ep=8)
    assert not any(u.fsdp for u in whole) and sum(u.dp_comm_s for u in whole) == 0.0
    assert all(u.fsdp for u in fsdp)
    assert sum(u.state_bytes for u in fsdp) < sum(u.state_bytes for u in whole)
    attn = next(i for i, u in enumerate(fsdp) if u.name.endswith("layers.0"))
    ctx = ours.ctx(1, 1, 1, "fsdp", "none", 1, 8)
    assert fsdp[attn].dp_comm_s > 0 and fsdp[attn].dp_gather_s == pytest.approx(fsdp[attn].dp_comm_s / 4)
    # the all-reduce after backward is gone: its optimizer row is the step on 1/ep of the elements
    assert sum(u.optimizer_s for u in fsdp) < sum(u.optimizer_s for u in whole)
    one = ours.evaluate(dict(dp=1, pp=1, tp=1, ep=8), "1F1B", 1, "fsdp", "none")
    assert one.step_s > 0 and ctx.dp == 1


def test_expert_biases_price_the_passes_the_runtime_makes():
    """GPT-OSS's experts carry biases: ours adds them by a gather and an add (5 passes over each GEMM's
    output, the gradient's scatter included); Megatron-Core fuses the gate/up bias into its weighted
    activation and scales the down bias by the routing weights apart (TEGroupedMLP._apply_bias: 12);
    a layout without biases pays none of it."""
    model = build_preset("gpt-oss-20b", num_layers=2)
    search = ClusterSearch.of(model, 8, hardware="h100_sxm", batch=(8, 1024), microbatch_sizes=(1,))
    ctx = search.ctx(1, 1, 1, "replicate", "none", 1, 8)
    g = search.moe_groups[0]
    assert g.layout.biases
    kw = dict(tokens=1024, dtype_bytes=2, ep=8, etp=1)
    none = ExpertRuntime(bias_passes=(0, 0), source="test")
    hw = ctx.hardware
    rows, f, h = 1024 * g.top_k, g.layout.ffn, g.layout.hidden
    per = 2 / (hw.memory_bandwidth * hw.efficiency.memory)   # bf16 bytes per element at achieved HBM speed
    ours = grouped_expert_time(ctx, g, **kw) - grouped_expert_time(ctx, g, runtime=dataclasses.replace(
        OUR_EXPERT_RUNTIME, bias_passes=(0, 0)), **kw)
    assert ours == pytest.approx((5 * rows * 2 * f + 5 * rows * h) * per)
    megatron = ExpertRuntime(bias_passes=(0, 12), source="test")
    assert grouped_expert_time(ctx, g, runtime=megatron, **kw) - grouped_expert_time(ctx, g, runtime=none, **kw) == \
        pytest.approx(12 * rows * h * per)
    unbiased = dataclasses.replace(g, layout=dataclasses.replace(g.layout, biases=False))
    assert grouped_expert_time(ctx, unbiased, **kw) == grouped_expert_time(ctx, unbiased, runtime=dataclasses.replace(
        OUR_EXPERT_RUNTIME, bias_passes=(0, 0)), **kw)
