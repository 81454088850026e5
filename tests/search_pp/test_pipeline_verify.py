"""Dry run of pipelined plans on a fake process group (rank 0): issued collectives == predicted
per (kind, mesh dim, bytes) with counts -- TP of rank 0's stages x micro-batches, FSDP per unit
(blocks re-gathered whenever the schedule finds them resharded), P2P send+recv per boundary and
micro-batch, the runtime's signature all-reduce -- and parameter bytes on rank 0."""
import pytest

from autoplan import plan_cluster
from autoplan.errors import AutoplanError
from autoplan.verify.dry_run import verify
from tests.planner.e2e_workers import build


def _plan(world, cons, **kw):
    return plan_cluster(build("llama", device="meta"), world, hardware="cpu", batch=(16, 16),
                        devices_per_node=world, constraints=dict(cons, fsdp=True), **kw)


@pytest.mark.parametrize("world,cons", [
    (8, {"pp": 2, "tp": 2, "dp": 2, "schedule": "1F1B", "microbatches": 4}),
    (4, {"pp": 2, "tp": 2, "dp": 1, "schedule": "GPipe", "microbatches": 4}),
    (8, {"pp": 2, "tp": 2, "dp": 2, "schedule": "ZeroBubble", "microbatches": 2}),
])
def test_pipeline_dry_run_matches_predictions_exactly(world, cons):
    plan = _plan(world, cons, allow_replicated_units=False)
    res = verify(plan, build("llama", device="meta"))
    assert res.passed, res.mismatches()
    want = {"send_recv", "all_reduce"} | ({"all_gather", "reduce_scatter"} if cons["dp"] > 1 else set())
    assert want <= set(res.collectives["kind"])


def test_pipeline_dry_run_says_what_it_cannot_check():
    plan = _plan(4, {"pp": 2, "tp": 1, "dp": 2, "schedule": "ZBV"})
    with pytest.raises(AutoplanError, match="one stage per rank"):
        verify(plan, build("llama", device="meta"))
