"""One stage with m > 1 micro-batches is gradient accumulation (Runner.forward_backward): the
search holds one micro-batch's activations, repeats FSDP's traffic per micro-batch and reduces
replicated dp / ZeRO-1 once; plan_cluster writes m micro-batches of b whose rows verify exactly
in the dry run (they were written as one pass of b x m before the runner accumulated)."""
import pytest

from autoplan import plan_cluster
from autoplan.search.pipeline.search import PipelineChoice, UnitCost, rank_memory, search_pipeline, time_choice
from autoplan.verify.dry_run import verify
from tests.search_pp.workers import build


def _units(fsdp: bool):
    return [UnitCost(f"u{i}", 1.0, 1.0, 1.0, state_bytes=10.0, act_bytes=3.0, dp_comm_s=0.5, dp_gather_s=0.2,
                     fsdp=fsdp) for i in range(4)]


@pytest.mark.parametrize("m", [1, 2, 4])
def test_one_stage_memory_is_one_micro_batch_of_activations(m):
    units = _units(fsdp=True)
    c = time_choice(PipelineChoice("1F1B", 1, 1, m, [0]), units, 0.0)
    assert c.peak_inflight == [1]
    assert c.rank_memory == [40.0 + 12.0] == rank_memory(PipelineChoice("1F1B", 1, 1, m, [0]), units)
    assert c.busy_s == [pytest.approx(m * 12.0)]   # compute (TP collectives inside) x m


@pytest.mark.parametrize("m", [1, 3])
def test_one_stage_fsdp_traffic_repeats_per_micro_batch_and_replicated_once(m):
    fsdp = time_choice(PipelineChoice("1F1B", 1, 1, m, [0]), _units(fsdp=True), 0.0, exposed_dp=lambda d, c: d)
    flat = time_choice(PipelineChoice("1F1B", 1, 1, m, [0]), _units(fsdp=False), 0.0, exposed_dp=lambda d, c: d)
    assert fsdp.step_s == pytest.approx(m * 12.0 + m * 4 * 0.5)
    assert flat.step_s == pytest.approx(m * 12.0 + 4 * 0.5)


def test_accumulation_lets_a_tight_memory_limit_fit_one_stage():
    """m micro-batches of one stage fit where the one pass of all m did not (4 x 3 x 4 bytes)."""
    units = _units(fsdp=True)
    got = search_pipeline(units, 1, [4], 40.0 + 12.0, 0.0)
    assert [c.m for c in got] == [4]


def _plan(world, cons, model="llama", **kw):
    return plan_cluster(build(model, device="meta"), world, hardware="cpu", batch=(16, 16),
                        devices_per_node=min(world, 8), constraints=cons, memory_limit=1e12, **kw)


@pytest.mark.parametrize("cons", [
    {"pp": 1, "tp": 2, "dp": 2, "microbatches": 2, "fsdp": True},
    {"pp": 1, "tp": 1, "dp": 4, "microbatches": 4, "fsdp": True},
    {"pp": 1, "tp": 1, "dp": 4, "microbatches": 2, "dp_mode": "replicate"},
    {"pp": 1, "tp": 2, "dp": 2, "microbatches": 2, "dp_mode": "zero1"},
])
def test_one_stage_plan_is_m_micro_batches_and_verifies_exactly(cons):
    plan = _plan(4, cons)
    m = cons["microbatches"]
    pipe = plan.pipeline
    assert (pipe["microbatches"], pipe["microbatch_size"], pipe["peak_inflight"]) == (m, 16 // cons["dp"] // m, [1])
    assert any("gradient accumulation" in n for n in plan.notes), plan.notes
    rows = plan.predictions["collectives"]
    per_step = [r for r in rows if r["mesh_dim"] == "dp" and plan.fsdp["mode"] != "fsdp"]
    assert all(r["count"] == 1 for r in per_step), per_step            # replicated / ZeRO-1: once per step
    assert all(r["count"] % m == 0 for r in rows if r not in per_step), rows   # everything else per micro-batch
    res = verify(plan, build("llama", device="meta"))
    assert res.passed, (res.error, res.mismatches())


def test_large_world_accumulation_plan_verifies_exactly():
    """A 64-device pp=1 plan with 2 micro-batches, on the fake group at its real world size."""
    model = build("llama", device="meta")
    plan = plan_cluster(model, 64, hardware="h100_sxm", batch=(256, 16), devices_per_node=8,
                        constraints={"pp": 1, "tp": 2, "dp": 32, "microbatches": 2, "fsdp": True})
    assert (plan.pipeline["microbatches"], plan.pipeline["microbatch_size"]) == (2, 4)
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches())
    assert (res.collectives["issued"] % 2 == 0).all()


def test_expert_parallel_accumulation_plan_syncs_experts_once_and_verifies():
    """Mixtral-8x7B's shape (2 layers) at world 64 with ep=8 and 2 micro-batches: the all-to-alls
    and FSDP repeat per micro-batch, the ep gradient all-reduce runs once after the last (under
    FSDP there is none: FSDP shards the non-expert parameters over dp x ep, once per micro-batch)."""
    from autoplan.presets import build_preset

    model = build_preset("mixtral-8x7b", num_layers=2)
    model.config.use_cache = False
    plan = plan_cluster(model, 64, batch=(128, 1024), hardware="h100_sxm",
                        constraints={"ep": 8, "pp": 1, "microbatches": 2})
    assert plan.pipeline["microbatches"] == 2
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches().to_string())
    df = res.collectives
    sync = df[(df["mesh_dim"] == "ep") & (df["kind"] == "all_reduce")]
    if plan.fsdp.get("mode") == "fsdp":
        dense = df[df["mesh_dim"] == "dp_ep"]
        assert not len(sync) and len(dense) and (dense["issued"] % 2 == 0).all(), df.to_string()
    else:
        assert len(sync) and (sync["issued"] == 1).all(), sync
    assert (df[df["kind"] == "all_to_all"]["issued"] % 2 == 0).all()


def test_plan_memory_is_one_micro_batch_whatever_the_count():
    """The plan's predicted activations at m micro-batches of b equal those of one micro-batch of
    b (twice the global batch, accumulated), not m times them."""
    def plan(gb, m):
        return plan_cluster(build("llama", device="meta"), 4, hardware="cpu", batch=(gb, 16), devices_per_node=4,
                            constraints={"pp": 1, "tp": 1, "dp": 4, "microbatches": m, "fsdp": True,
                                         "activation_checkpointing": False}, microbatch_sizes=(2,), memory_limit=1e12)
    one, two = plan(8, 1), plan(16, 2)
    assert two.pipeline["microbatch_size"] == one.pipeline["microbatch_size"] == 2
    act = [p.predictions["memory_bytes"]["activations"] for p in (one, two)]
    assert act[0] == act[1] > 0, act
    assert two.predictions["memory_bytes"]["total"] == one.predictions["memory_bytes"]["total"]
