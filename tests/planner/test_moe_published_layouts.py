"""The layouts published MoE runs train with, asked of the public planner: ``plan_cluster`` with
the layout as constraints returns a plan whose memory holds the non-expert state sharded over
dp x ep -- under FSDP (at dp 1 too: FSDP over ep alone, NeMo AutoModel's "FSDP 64" at ep 64) and
under ZeRO-1 (Megatron-Core's distributed optimizer over the whole data-parallel group) -- ep with
pp is searched, and an ep x pp plan's ``predictions.memory_bytes`` is the per-rank figure the
search checked. Facts of another framework's runtime are constraints checked like the others."""
import pytest

from autoplan import plan_cluster
from autoplan.errors import InvalidConstraintError
from autoplan.verify.dry_run import verify
from autoplan.search.experts.search import DEEPEP_RUNTIME
from tests.runtime.ep_workers import build

BATCH = (4, 8)


@pytest.fixture(scope="module")
def qwen3():
    model = build("qwen3_moe")[0].to("meta")
    model.config.use_cache = False
    return model


_PLANS = {}


def _plan(model, world, **cons):
    """plan_cluster with ``cons`` (each layout planned once per module: planning is the slow part)."""
    key = (world, tuple(sorted((k, repr(v)) for k, v in cons.items())))
    if key not in _PLANS:
        _PLANS[key] = plan_cluster(model, world, hardware="cpu", batch=BATCH, devices_per_node=world,
                                   constraints=dict(dict(tp=1, pp=1, microbatch_size=1, expert_parallel=True), **cons))
    return _PLANS[key]


def _rows(plan, kind, dim):
    return [r for r in plan.predictions["collectives"] if r["kind"] == kind and r["mesh_dim"] == dim]


def test_fsdp_at_dp_1_shards_the_non_expert_state_over_ep(qwen3):
    """dp 1 x ep 4: FSDP over the flattened dp x ep mesh holds 1/4 of every non-expert parameter;
    replicated, each rank holds all of them."""
    fsdp = _plan(qwen3, 4, dp=1, ep=4, dp_mode="fsdp")
    whole = _plan(qwen3, 4, dp=1, ep=4, dp_mode="replicate")
    assert fsdp.fsdp["enabled"] and fsdp.fsdp["mode"] == "fsdp"
    assert _rows(fsdp, "reduce_scatter", "dp_ep") and not _rows(fsdp, "all_reduce", "ep")
    assert _rows(whole, "all_reduce", "ep")
    got, rep = fsdp.predictions["memory_bytes"], whole.predictions["memory_bytes"]
    assert got["params"] < 0.6 * rep["params"] and got["optimizer"] < 0.6 * rep["optimizer"], (got, rep)


def test_zero1_with_ep_shards_the_optimizer_over_dp_x_ep(qwen3):
    """ZeRO-1 is searched with ep: the non-expert parameters' reduce-scatter and all-gather run
    over dp x ep (no all-reduce over ep follows), the experts' over dp; the optimizer state shrinks."""
    z = _plan(qwen3, 4, dp=2, ep=2, dp_mode="zero1")
    rep = _plan(qwen3, 4, dp=2, ep=2, dp_mode="replicate")
    assert z.fsdp == {"enabled": False, "dim": "dp", "mode": "zero1"}
    assert _rows(z, "reduce_scatter", "dp_ep") and _rows(z, "all_gather", "dp_ep") and _rows(z, "reduce_scatter", "dp")
    assert not _rows(z, "all_reduce", "ep")
    assert z.predictions["memory_bytes"]["optimizer"] < 0.5 * rep.predictions["memory_bytes"]["optimizer"]


@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_ep_with_pp_plans_and_reports_the_search_s_memory_per_rank(qwen3, mode):
    """ep x pp with either mode: the plan's memory is the busiest rank's figure the search checked
    (one number per rank, the pipeline's own), and it is within the device."""
    plan = _plan(qwen3, 4, dp=1, ep=2, pp=2, dp_mode=mode, schedule="1F1B")
    mesh = dict(zip(plan.mesh["names"], plan.mesh["shape"]))
    assert mesh["ep"] == 2 and mesh["pp"] == 2 and plan.parallel["ep"]["styles"]
    per_rank = {}
    for row in plan.pipeline["per_stage"]:
        per_rank[row["rank"]] = max(per_rank.get(row["rank"], 0), row["memory_bytes"])
    total = plan.predictions["memory_bytes"]["total"]
    assert abs(total - max(per_rank.values())) <= 4, (total, per_rank)


def test_even_cuts_are_a_constraint(qwen3):
    plan = _plan(qwen3, 4, dp=1, ep=2, pp=2, dp_mode="fsdp", schedule="1F1B", cuts="even")
    stages = plan.pipeline["stages"]
    blocks = [sum(1 for u in s if ".layers." in u) for s in stages]
    assert max(blocks) - min(blocks) <= 1, stages


def test_a_stated_runtime_is_priced_and_named(qwen3):
    ours = _plan(qwen3, 4, dp=1, ep=4, dp_mode="fsdp")
    theirs = _plan(qwen3, 4, dp=1, ep=4, dp_mode="fsdp", expert_runtime="deepep")
    same = _plan(qwen3, 4, dp=1, ep=4, dp_mode="fsdp", expert_runtime=DEEPEP_RUNTIME)
    assert theirs.predictions["step_s"] == same.predictions["step_s"] != ours.predictions["step_s"]
    assert any("another runtime" in n for n in theirs.notes)


@pytest.mark.parametrize("key,value,valid", [
    ("expert_runtime", "nope", "deepep"), ("cuts", "odd", "even"), ("attention_kernel", "fast", "flex_attention"),
    ("loss_bytes_per_logit", -1, "positive"), ("loss_bytes_per_logit", True, "positive"),
])
def test_runtime_facts_are_checked(qwen3, key, value, valid):
    with pytest.raises(InvalidConstraintError, match=valid) as e:
        _plan(qwen3, 4, dp=1, ep=4, **{key: value})
    assert key in str(e.value)


@pytest.mark.parametrize("name,cons", [
    ("mixtral", dict(dp=1, ep=16, pp=1, tp=4, dp_mode="zero1")),                      # 2 micro-batches accumulated
    ("qwen3_moe", dict(dp=4, ep=4, pp=2, tp=2, dp_mode="zero1", schedule="1F1B")),   # tied head across stages
    ("mixtral", dict(dp=1, ep=8, pp=2, tp=4, dp_mode="fsdp", schedule="1F1B")),      # FSDP over ep alone
])
def test_state_over_ep_dry_runs_as_predicted_at_world_64(name, cons):
    """ZeRO-1 over dp x ep (one flat reduce-scatter and all-gather of the non-expert parameters on
    dp_ep, the experts' on dp, once per step, no all-reduce over ep) and FSDP over ep at dp 1: every
    pipeline rank issues exactly the predicted collectives and holds the predicted parameter bytes."""
    model = build(name)[0].to("meta")
    model.config.use_cache = False
    model.tie_weights()
    plan = plan_cluster(model, 64, hardware="cpu", batch=(32, 8), devices_per_node=64,
                        constraints=dict(cons, expert_parallel=True, microbatch_size=1))
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches().to_string())
    dims = set(res.collectives[res.collectives["issued"] > 0]["mesh_dim"])
    assert "dp_ep" in dims, dims


def test_the_public_call_prices_a_layout_as_the_search_does(qwen3):
    """What plan_cluster returns for a fixed layout is what the search's own pricing of that layout
    says (``ClusterSearch.evaluate``, the path benchmarks used before): one price, two doors."""
    from autoplan.search.mesh.search import ClusterSearch

    plan = _plan(qwen3, 4, dp=1, ep=2, pp=2, dp_mode="fsdp", schedule="1F1B", cuts="even", recompute="none",
                 expert_runtime="deepep")
    search = ClusterSearch.of(qwen3, 4, hardware="cpu", batch=BATCH, devices_per_node=4, microbatch_sizes=(1,),
                              expert_runtime=DEEPEP_RUNTIME, constraints={"expert_parallel": True})
    cand = search.evaluate(dict(dp=1, pp=2, tp=1, ep=2), "1F1B", 1, "fsdp", "none", cuts="even")
    assert plan.predictions["step_s"] == pytest.approx(cand.step_s, rel=1e-9)
    assert plan.predictions["memory_bytes"]["total"] == pytest.approx(max(cand.choice.rank_memory), abs=4)
