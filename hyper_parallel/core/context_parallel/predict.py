"""The collectives one context-parallel attention call issues, for the planner and verify.

Per attention call (one layer, one micro-batch), on every rank of a cp group of size ``cp``, with
the local key/value shard of ``kv_bytes`` = batch · kv_heads_local · (seq / cp) · head_dim · 2 (k and
v) · dtype bytes (``kv_heads_local`` = KV heads / tp when tensor parallel shards the heads):

ring (``ring.py``): every message is one batched isend + irecv of one buffer, which the recorder
sees as two ``send_recv`` events (a send and a receive) of the buffer's bytes -- so ``count``
counts both directions, 2 per message:
    forward  : cp - 1 messages of [k|v]                         -> send_recv, kv_bytes, 2·(cp-1)
    backward : cp - 1 messages of [k|v] and cp of [dk|dv]       -> send_recv, kv_bytes, 2·(2·cp-1)
allgather (``allgather.py``), bytes logical (the gathered / pre-scatter tensor, cost_models'
convention):
    forward  : all_gather of [k|v]                              -> all_gather, kv_bytes · cp, 1
    backward : reduce_scatter of [dk|dv]                        -> reduce_scatter, kv_bytes · cp, 1
Nothing is issued when cp == 1. The loss (``cp_cross_entropy``) adds one all_reduce of 16 bytes
per step; ``average_gradients`` one all_reduce per parameter: both outside attention, not listed.
"""
from __future__ import annotations

from hyper_parallel.core.collective import Collective
from hyper_parallel.core.context_parallel.attention import check_variant
from hyper_parallel.errors import DivisibilityError


def kv_shard_bytes(*, batch: int, seq_len: int, n_kv_heads: int, head_dim: int, cp: int, tp: int = 1,
                   dtype_bytes: int = 4) -> int:
    """Bytes of one rank's [k|v] shard for one attention call (``seq_len`` global)."""
    if seq_len % (2 * cp):
        raise DivisibilityError(f"kv_shard_bytes: seq_len {seq_len} is not divisible by 2·cp = {2 * cp}")
    if n_kv_heads % tp:
        raise DivisibilityError(f"kv_shard_bytes: n_kv_heads {n_kv_heads} is not divisible by tp = {tp}")
    return batch * (n_kv_heads // tp) * (seq_len // cp) * head_dim * 2 * dtype_bytes


def predicted_collectives(*, variant: str, batch: int, seq_len: int, n_kv_heads: int, head_dim: int, cp: int,
                          tp: int = 1, dtype_bytes: int = 4, calls: int = 1, dim: str = "cp") -> list[Collective]:
    """The collectives of ``calls`` context-parallel attention calls (layers × micro-batches) of one
    training step (forward and backward), per rank, over mesh dimension ``dim``."""
    check_variant(variant, "predicted_collectives")
    if cp == 1:
        return []
    kv = kv_shard_bytes(batch=batch, seq_len=seq_len, n_kv_heads=n_kv_heads, head_dim=head_dim, cp=cp, tp=tp,
                        dtype_bytes=dtype_bytes)
    if variant == "ring":
        out = [Collective("send_recv", "forward", kv, 2 * (cp - 1), dim),
               Collective("send_recv", "backward", kv, 2 * (2 * cp - 1), dim)]
    else:
        out = [Collective("all_gather", "forward", kv * cp, 1, dim),
               Collective("reduce_scatter", "backward", kv * cp, 1, dim)]
    return [c.scaled(calls) for c in out]
