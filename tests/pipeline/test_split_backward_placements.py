"""Split backward (ZeroBubble, ZBV) on a sequence-sharded stream: the weight pass hands each
parameter its gradient in the parameter's placements, as a full backward does.

The weight pass asks autograd for what flows into each parameter's accumulator. For a replicated
norm weight on a sequence shard that is a partial sum over tp; stored as it was, the gradient
stayed Partial -- the numbers gathered right, but the per-micro-batch all-reduce the plan predicts
was never issued (verify failed on the pipeline rank holding the norms) and anything reading the
local gradient (clipping, a hook) would read a partial sum. Both checks below failed before.
"""
import pytest
import torch

from autoplan import plan_cluster
from autoplan.verify.corpus import real_model, seq_len, small_recipe
from autoplan.verify.dry_run import verify
from autoplan.verify.numerics import check_numerics


@pytest.mark.parametrize("schedule", ["ZeroBubble", "ZBV"])
def test_split_backward_reduces_sequence_parallel_weight_gradients(schedule, pool4):
    model = real_model("llama")
    plan = plan_cluster(model, 4, hardware="h100_sxm", batch=(8, seq_len(model)), dtype=torch.float32,
                        constraints={"pp": 2, "tp": 2, "schedule": schedule}, sequence_parallel=True)
    assert plan.stream_layout == "S" and plan.pipeline["schedule"] == schedule
    dry = verify(plan, model)
    assert dry.passed, dry.mismatches()
    result = check_numerics(plan, small_recipe("llama", model, [2, 2]), pool=pool4,
                            global_batch=plan.pipeline["microbatches"])
    assert result.passed, result.summary()


@pytest.mark.parametrize("schedule", ["ZeroBubble", "ZBV"])
def test_fsdp_split_backward_rows_leave_out_weight_only_reductions(schedule):
    """On FSDP stages the input pass is autograd.grad to the stage inputs and the weight pass a
    whole backward, so the plan counts backward TP collectives twice -- but a reduction of a
    weight's gradient alone (Collective.weight_grad: the sequence-parallel norm weights) only in
    the weight pass. Every rank's rows were 1 per micro-batch too many before."""
    model = real_model("llama")
    plan = plan_cluster(model, 8, hardware="h100_sxm", batch=(16, seq_len(model)), dtype=torch.float32,
                        constraints={"pp": 2, "tp": 2, "dp": 2, "schedule": schedule, "dp_mode": "fsdp"},
                        sequence_parallel=True)
    assert plan.stream_layout == "S" and plan.fsdp["mode"] == "fsdp"
    dry = verify(plan, model)
    assert dry.passed, dry.mismatches()
