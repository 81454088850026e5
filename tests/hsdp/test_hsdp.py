"""HSDP (data parallel as dp_replicate x dp_shard, fully_shard on a 2-D mesh): the split search,
the plan, exact verify in the dry run (8 ranks and 512 GPUs), and one step on 8 gloo ranks equal
to one device (loss rtol 1e-5; every gradient and SGD-updated parameter rtol 1e-4 / atol 1e-6)."""
import pytest

from autoplan.errors import PlanningError
from autoplan.hsdp import plan_hsdp
from autoplan.models import build_llama
from autoplan.plan import Plan
from autoplan.search.data.hsdp_splits import hsdp_replicate_rows, hsdp_splits
from autoplan.verify.dry_run import verify
from tests.hsdp.workers import run_hsdp_case
from tests.planner.e2e_workers import build

BATCH, SEQ = 8, 16


def _plan_222():
    return plan_hsdp(build("llama", device="meta"), 8, tp=2, batch=(BATCH, SEQ), hardware="cpu",
                     devices_per_node=4, split=(2, 2), allow_replicated_units=False)


def test_splits_follow_node_boundaries():
    # 512 GPUs, tp=8 on 8-GPU nodes: a shard group of s*8 ranks covers s whole nodes
    assert hsdp_splits(64, 8, 8) == [(32, 2), (16, 4), (8, 8), (4, 16), (2, 32), (1, 64)]
    # tp=2 on 8-GPU nodes: shard groups of 2*s ranks; s=2 (4 ranks) and s=4 (one node) fit a node,
    # s=8 and s=16 cover whole nodes; nothing straddles a node edge
    assert hsdp_splits(16, 2, 8) == [(8, 2), (4, 4), (2, 8), (1, 16)]
    # 6-GPU nodes: a shard group of 4 ranks would straddle node edges
    assert (3, 4) not in hsdp_splits(12, 1, 6) and (2, 6) in hsdp_splits(12, 1, 6)
    with pytest.raises(PlanningError, match="devices_per_node=0"):
        hsdp_splits(4, 1, 0)


def test_replicate_rows_are_one_all_reduce_per_reduce_scatter_of_the_shard():
    rows = [{"kind": "reduce_scatter", "mesh_dim": "dp_shard", "phase": "backward", "bytes": 400, "count": 2},
            {"kind": "all_gather", "mesh_dim": "dp_shard", "phase": "forward", "bytes": 400, "count": 2}]
    assert hsdp_replicate_rows(rows, shard=4, replicate=2) == [
        {"kind": "all_reduce", "mesh_dim": "dp_replicate", "phase": "backward", "bytes": 100, "count": 2}]
    assert hsdp_replicate_rows(rows, shard=4, replicate=1) == []


def test_hsdp_plan_round_trips_and_verifies_exactly_on_8_ranks():
    plan = _plan_222()
    assert dict(zip(plan.mesh["names"], plan.mesh["shape"])) == {"dp_replicate": 2, "dp_shard": 2, "tp": 2}
    assert plan.fsdp == {"enabled": True, "dim": "dp_shard", "replicate_dim": "dp_replicate",
                         "replicate": 2, "shard": 2}
    assert plan.styles and plan.batch["global_batch"] == BATCH
    again = Plan.from_json(plan.to_json())
    assert again.fsdp == plan.fsdp and again.mesh == plan.mesh
    res = verify(again, build("llama", device="meta"))
    assert res.passed, res.mismatches()
    dims = set(res.collectives[res.collectives["issued"] > 0]["mesh_dim"])
    assert {"dp_replicate", "dp_shard", "tp"} <= dims


def test_planner_prices_every_split_and_picks_the_cheapest():
    plan = plan_hsdp(build("llama", device="meta"), 8, tp=1, batch=(BATCH, SEQ), hardware="cpu",
                     devices_per_node=4)
    others = [a for a in plan.alternatives if a["name"].startswith("hsdp ")]
    assert len(others) == len(hsdp_splits(8, 1, 4)) - 1
    assert all(plan.predictions["step_s"] <= a["step_s"] for a in others)


def test_plan_hsdp_rejects_a_split_that_does_not_multiply():
    with pytest.raises(PlanningError, match="must multiply to dp=4"):
        plan_hsdp(build("llama", device="meta"), 8, tp=2, batch=(BATCH, SEQ), hardware="cpu", split=(2, 3))


def test_512_gpu_hsdp_plan_verifies_in_the_dry_run():
    # Llama-3-8B widths, 2 layers (the 80-layer 70B run is benchmarks/hsdp_scale.py)
    model = build_llama(device="meta", dim=4096, n_layers=2, n_heads=32, n_kv_heads=8, vocab_size=128256,
                        ffn_hidden=14336, max_seq_len=2048)
    plan = plan_hsdp(model, 512, tp=8, batch=(256, 2048), split=(8, 8))
    assert dict(zip(plan.mesh["names"], plan.mesh["shape"])) == {"dp_replicate": 8, "dp_shard": 8, "tp": 8}
    res = verify(plan, model)
    assert res.passed, res.mismatches()
    assert (res.collectives["mesh_dim"] == "dp_replicate").any()


def test_hsdp_222_matches_one_device_on_8_gloo_ranks(pool8):
    plan = _plan_222()
    for r in pool8.run(run_hsdp_case, plan.to_json(), "llama", BATCH, SEQ):
        assert r["n_grads"] > 0
        assert r["par"] == pytest.approx(r["ref"], rel=1e-5), r
        assert not r["bad_grads"] and not r["bad_params"], r
        # w1 lives on (dp_replicate, dp_shard, tp): replicated across replicas, sharded within one
        assert r["mesh"] == ["dp_replicate", "dp_shard", "tp"], r
        assert r["placements"][0] == "Replicate" and r["placements"][1].endswith("Shard"), r  # _StridedShard with TP
