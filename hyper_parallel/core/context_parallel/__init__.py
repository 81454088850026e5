"""Context parallelism: the sequence sharded over a ``cp`` mesh dimension for the whole model.

- ``layout``: the load-balanced layout (rank r holds chunks r and 2·cp-1-r of 2·cp),
  ``shard_batch`` / ``shard_sequence`` / ``unshard_sequence`` / ``local_positions``
- ``ring`` and ``allgather``: the two attention variants; ``attention.CPAttention`` picks one
- ``style``: the ``ContextParallel`` style and ``apply_context_parallel`` (repo Llama, transformers models)
- ``loss``: ``cp_cross_entropy`` (the global-batch mean) and ``average_gradients``
- ``predict``: ``predicted_collectives`` per attention call, as ``Collective`` rows
"""
from hyper_parallel.core.context_parallel.attention import VARIANTS, CPAttention
from hyper_parallel.core.context_parallel.hf import HF_ATTENTION_NAME, hf_cp_attention
from hyper_parallel.core.context_parallel.layout import (
    chunk_ids,
    local_positions,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)
from hyper_parallel.core.context_parallel.loss import average_gradients, cp_cross_entropy
from hyper_parallel.core.context_parallel.predict import kv_shard_bytes, predicted_collectives
from hyper_parallel.core.context_parallel.style import ContextParallel, apply_context_parallel

__all__ = [
    "CPAttention", "ContextParallel", "HF_ATTENTION_NAME", "VARIANTS", "apply_context_parallel", "average_gradients",
    "chunk_ids", "cp_cross_entropy", "hf_cp_attention", "kv_shard_bytes", "local_positions", "predicted_collectives",
    "shard_batch", "shard_sequence", "unshard_sequence",
]
