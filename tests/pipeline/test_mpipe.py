"""MPipe on 4 gloo ranks: the tiny VL model's vision tower runs on the micro-batch's
owner rank, its output is transposed to stage 0 and its gradient back; one training step equals
one device (loss rtol 1e-5, every gradient -- the tower's included -- rtol 1e-4 / atol 1e-6):
pp=4 under 1F1B, ZeroBubble and Interleaved1F1B, and pp=2 x tp=2 (TP in the tower and the decoder),
with a tensor-valued and a tuple-valued tower output (DeepStack levels, with and without grad)."""
from tests.pipeline.mpipe_workers import run_llava_mpipe, run_mpipe

# (schedule, micro-batches, DeepStack levels, levels need grad, placement, batch)
PP4 = [("1F1B", 4, 0, True, "front", 8), ("1F1B", 8, 1, True, "timed", 8),
       ("ZeroBubble", 4, 1, False, "front", 8), ("Interleaved1F1B", 4, 1, True, "front", 8),
       ("1F1B", 2, 1, True, "front", 4)]   # fewer micro-batches than ranks: ranks 2, 3 own no tower
PP2_TP2 = [("1F1B", 4, 0, True, "front", 8), ("ZeroBubble", 4, 1, True, "timed", 8),
           ("Interleaved1F1B", 2, 1, False, "front", 4)]


def _check(results):
    for rank, res in enumerate(results):
        for r in res:
            assert r["n_params"] > 0 and r["n_tower"] > 0, (rank, r)
            assert r["grad_err"] < 1e-4, (rank, r)
            assert r["tower_err"] < 1e-4, (rank, r)
            if r["loss_err"] is not None:
                assert r["loss_err"] < 1e-5, (rank, r)
                assert r["n_losses"] == r["case"][1], (rank, r)
    assert sum(r["loss_err"] is not None for res in results for r in res) > 0


def test_mpipe_pp4_equals_one_device(pool4):
    _check(pool4.run(run_mpipe, PP4))


def test_mpipe_pp2_tp2_equals_one_device(pool4):
    _check(pool4.run(run_mpipe, PP2_TP2, tp=2))


def test_mpipe_dp2_pp2_fsdp_overlap_and_accumulation(pool4):
    """FSDP on the decoder stages over dp=2 (the tower's gradients: summed over pp, averaged over
    dp), receives posted ahead (overlap), and a second step without zero_grad: twice one device."""
    _check(pool4.run(run_mpipe, [("1F1B", 4, 1, True, "front", 8), ("ZeroBubble", 2, 0, True, "timed", 8)],
                     dp=2, overlap=True))
    _check(pool4.run(run_mpipe, [("1F1B", 4, 1, False, "front", 8)], second_step=True))


def test_mpipe_transformers_llava_equals_one_device(pool4):
    """transformers' LLaVA: the CLIP tower + projector (ImageFeatures: the model's own
    get_image_features) under MPipe, handed to stage 0's forward as mm_encoder_outputs; the Llama
    decoder cut over pp=4, each stage running the model's own forward."""
    _check(pool4.run(run_llava_mpipe, [("ZeroBubble", 4)]))
