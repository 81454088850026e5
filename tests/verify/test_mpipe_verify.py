"""verify covers MPipe through plans: verify's pipeline dry run of an autoplan plan with a
``pipeline.preprocess`` tower issues exactly the planner's rows on every rank -- decoder boundaries, the
transposed tower output (every tuple element) and its gradient (only the elements that need one), the
agreement and tower-gradient all-reduces. The rows come from the lowered MPipe IR (tower_plan)."""
from collections import Counter

import torch

from autoplan import autoplan
from autoplan.models.vision_language import build_vision_language
from autoplan.search.pipeline.tower_plan import mpipe_rank_rows
from autoplan.verify import verify
from hyper_parallel.core.pipeline_parallel import build_schedule

TOWER = {"n_layers": 4, "width": 64, "mlp_hidden": 256}


def _model():
    return build_vision_language(deepstack_levels=1, deepstack_grad=False, n_patches=8, vision=TOWER)


def test_zero_bubble_tuple_tower_plan_verifies_exactly():
    plan = autoplan(_model(), 4, batch=(8, 12), dtype=torch.float32, devices_per_node=4,
                    constraints={"pp": 4, "tp": 1, "dp": 1, "schedule": "ZeroBubble", "microbatches": 4},
                    microbatch_sizes=(2,))
    assert plan.pipeline["preprocess"]["placement"] == "mpipe"
    res = verify(plan, _model())
    assert res.passed, res.mismatches()
    df = res.collectives
    assert set(df["pp_rank"]) == {0, 1, 2, 3}
    # the transposed tuple (embeddings 2048 B + a level 2048 B) and the gradient of the embeddings only:
    # stage 0's rank receives 3 remote micro-batches x 2 tensors and sends 3 gradients back
    row = df[(df.pp_rank == 0) & (df.kind == "send_recv") & (df.bytes == 2048)]
    assert int(row["issued"].iloc[0]) == int(row["predicted"].iloc[0]) == 3 * 2 + 3


def test_rows_count_tuple_elements_and_reduction():
    rows = mpipe_rank_rows(build_schedule("1F1B", 2, 4), [(10, True), (20, False)], [7, 9])
    # rank 1 owns micro-batches 1 and 3: sends (10 + 20) twice, receives 10 twice; reduces 7 and 9 once
    got = Counter()
    for c in rows[1]:
        got[(c.kind, c.nbytes)] += c.count
    assert got == Counter({("send_recv", 10): 4, ("send_recv", 20): 2, ("all_reduce", 7): 1, ("all_reduce", 9): 1})
    assert sum(c.count for c in rows[0] if c.nbytes == 10) == 4
