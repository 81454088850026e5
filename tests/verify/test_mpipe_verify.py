"""verify covers MPipe (issue 20): a dry run of every pipeline rank on a fake group issues exactly
the P2P (decoder boundaries, transposed tower output, its gradient -- only for the tuple elements
that need one) and the all-reduces (agreement, tower-gradient sum) read off the lowered IR."""
from collections import Counter

from autoplan.models.vision_language import build_vision_language, vl_batch
from autoplan.verify.mpipe_dry_run import predicted_mpipe_collectives, verify_mpipe
from hyper_parallel.core.pipeline_parallel import build_schedule, lower, mpipe


def _model():
    return build_vision_language(deepstack_levels=1, deepstack_grad=False)


def test_dry_run_matches_prediction_exactly():
    x, pv, y = vl_batch(_model(), 8, 12)
    res = verify_mpipe(_model, x, pv, y, pp=4, n_microbatches=8, schedule="ZeroBubble")
    assert res.passed, res.mismatches()
    df = res.collectives
    assert set(df["pp_rank"]) == {0, 1, 2, 3}
    # the transposed tuple (embeddings 512 B + a level 512 B) and the gradient of the embeddings only:
    # stage 0's rank receives 6 remote micro-batches x 2 tensors and sends 6 gradients back
    row = df[(df.pp_rank == 0) & (df.kind == "send_recv") & (df.bytes == 512)]
    assert int(row["issued"].iloc[0]) == 6 * 2 + 6


def test_prediction_counts_tuple_elements_and_reduction():
    ir = lower(mpipe(build_schedule("1F1B", 2, 4)))
    want = predicted_mpipe_collectives(ir, {1: [100]}, [(10, True), (20, False)], [7, 9])
    # rank 1 owns micro-batches 1 and 3: sends (10 + 20) twice, receives 10 twice; boundary 4 + 4 P2P
    assert want[1] == Counter({("send_recv", 10): 4, ("send_recv", 20): 2, ("send_recv", 100): 8,
                               ("all_reduce", 56): 1, ("all_reduce", 7): 1, ("all_reduce", 9): 1})
    assert want[0][("send_recv", 10)] == 4 and want[0][("send_recv", 20)] == 2
