"""Hand-written expert plans for the repo Llama, as hyper_parallel style dicts.

These are the public torchtitan Llama-3 TP+SP plan and plain Megatron TP (no sequence
parallel), each with and without loss parallel -- see shared/reference/expert_plans.json.
They are the baseline the planner must rediscover and the plans the runtime tests apply.
"""
from __future__ import annotations

from hyper_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
)


def torchtitan_plan(loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """torchtitan apply_tp: sequence parallel between blocks, all-gather into attention/FFN."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(reduce_grads=True),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        "layers.*.attention_norm": SequenceParallel(reduce_grads=True),
        "layers.*.attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(reduce_grads=True),
        "layers.*.feed_forward": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.feed_forward.w3": ColwiseParallel(),
    }


def megatron_plan(loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Megatron-LM TP without sequence parallel: replicated residual stream, all-reduce after
    wo and w2, vocabulary-parallel embedding, norms left replicated (not in the plan)."""
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "output": ColwiseParallel(
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }


EXPERT_PLANS = {
    "torchtitan": lambda: torchtitan_plan(loss_parallel=True),
    "torchtitan_no_loss_parallel": lambda: torchtitan_plan(loss_parallel=False),
    "megatron": lambda: megatron_plan(loss_parallel=False),
    "megatron_loss_parallel": lambda: megatron_plan(loss_parallel=True),
}
