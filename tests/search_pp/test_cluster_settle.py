"""plan_cluster prices every tensor-parallel degree's pick before running it, and runs only the
pick it keeps: a kept pick the run rejects or repairs must never reach the plan as priced."""
import pytest
import torch

from autoplan import MeshSpec, autoplan, plan_cluster
from autoplan.errors import InfeasiblePlanError
from autoplan.search.mesh.search import ClusterSearch, _tp_key
from tests.planner.models import TinyLM

BATCH = (8, 1024)


def _meta(**kw):
    with torch.device("meta"):
        return TinyLM(**kw)


def _search(model, **kw):
    return ClusterSearch.of(model, 4, hardware="h100_sxm", batch=BATCH, dtype=torch.float32,
                         constraints={"tp": 4, "pp": 1}, sequence_parallel=False, **kw)


def _attention_strategies(search, cand) -> set[str]:
    options, _ = search.tp_solution(cand.tp, cand.b, cand.recompute, cand.cp)
    return {o.strategy.name for o in options if o.slot.endswith("/attention")}


def test_a_rejected_pick_is_priced_again_and_the_search_repeated():
    """The cheapest tp=4 pick shards the attention, whose global head count cannot be made local:
    the run rejects it, the degree is priced again without it, and the plan keeps it replicated."""
    search = _search(_meta(count_name="n"))
    unchecked = search.tp_solution(4, 1, "none")
    assert any(o.strategy.name == "heads_sharded" for o in unchecked[0]), "the test needs a sharded unchecked pick"
    best = search.search()[0]
    assert _tp_key(best.tp, best.b, best.recompute) in search._settled
    assert _attention_strategies(search, best) == {"replicate"}


def test_a_repaired_pick_is_the_one_the_plan_applies():
    """The count can be made local: the run repairs the pick (PrepareHeadsInput), and the plan the
    cluster search writes is the one a fixed-mesh autoplan (which runs every pick) writes."""
    model = _meta()
    plan = plan_cluster(model, 4, hardware="h100_sxm", batch=BATCH, dtype=torch.float32,
                        constraints={"tp": 4, "pp": 1, "dp": 1}, sequence_parallel=False)
    assert plan.styles["layers.*.attn"]["style"] == "PrepareHeadsInput", plan.styles
    fixed = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=BATCH, dtype=torch.float32,
                     sequence_parallel=False)
    assert fixed.styles == plan.styles
    assert any(n.startswith("layers.*.attn: heads_sharded") and "rejected" in n for n in plan.notes), plan.notes


def test_every_kept_pick_has_run_and_a_fully_sharded_request_is_refused():
    with pytest.raises(InfeasiblePlanError):
        plan_cluster(_meta(count_name="n"), 4, hardware="h100_sxm", batch=BATCH, dtype=torch.float32,
                     constraints={"tp": 4, "pp": 1}, sequence_parallel=False, allow_replicated_units=False)
