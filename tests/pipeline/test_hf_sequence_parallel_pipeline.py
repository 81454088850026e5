"""A transformers decoder cut into pipeline stages on a sequence-sharded stream (Mistral at its
real width, pp2 x tp2, Interleaved1F1B: the embedding alone on stage 0, one decoder layer on each
of the next two stages).

Three things were wrong here before, each asserted below:
- a stage that receives a sequence shard built RoPE and the causal mask for its local length
  (1,024 of 2,048 positions) and crashed in attention; the pipeline runner now passes the step's
  ``sequence_length`` and the stage builds them for the whole sequence;
- the plan priced every boundary as the sharded stream, but the stream is sharded at the first
  block's input, so the boundary in front of it carries the embedding's whole output;
- the entry's gradient all-gather was counted on the embedding's rank, where the runtime issues it
  on the first block's.
"""
import torch

from autoplan import plan_cluster
from autoplan.verify.corpus import real_model, seq_len
from autoplan.verify.dry_run import verify


def test_hf_decoder_pipelined_on_a_sequence_sharded_stream_verifies_on_every_rank():
    model = real_model("mistral")
    plan = plan_cluster(model, 4, hardware="h100_sxm", batch=(8, seq_len(model)), dtype=torch.float32,
                        constraints={"pp": 2, "tp": 2, "schedule": "Interleaved1F1B"}, sequence_parallel=True)
    assert plan.stream_layout == "S"
    assert plan.pipeline["stages"][:3] == [["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"]]
    dry = verify(plan, model)
    assert dry.error is None, dry.error
    assert dry.passed, dry.collectives[~dry.collectives.match]
    hidden = 8 // plan.pipeline["microbatches"] * seq_len(model) * model.config.hidden_size * 4
    rows = {(r["kind"], r["bytes"]) for r in plan.pipeline["rank_collectives"][0]}
    assert ("send_recv", hidden) in rows and ("send_recv", hidden // 2) in rows, rows
