"""All-gather-KV context parallel attention: gather every rank's keys/values once, attend locally.

Why a second variant: with grouped-query attention the key/value heads are few (Llama-3: 8 for 64
or 128 query heads), so gathering them all once is one collective of (cp-1)/cp · S · 2·hk·d
elements -- the same bytes the ring moves, in one call instead of cp - 1 dependent steps, and its
backward is one reduce-scatter of the key/value gradients (each rank's queries contribute to every
rank's keys). It costs the memory of the whole sequence's keys/values per rank, which is what
makes the ring the choice when hk is large. Masking is by global positions, as in the ring.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from hyper_parallel.core.context_parallel.kernels import SpanAttention
from hyper_parallel.core.context_parallel.layout import global_order, local_spans


class GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (the sequence of (b, heads, s, d)) in forward; reduce-scatter (sum)
    of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), gather_dim=2, group=group))

    @staticmethod
    def backward(ctx, grad):
        out = funcol.reduce_scatter_single(grad.contiguous(), "sum", scatter_dim=2, group=ctx.group)
        return funcol.wait_tensor(out), None


def allgather_attention(q, k, v, group, rank: int, size: int, scale: float) -> torch.Tensor:
    """Causal attention of local q over the gathered keys/values (load-balanced layout): the gathered
    sequence is put in global order and cut into its 2·cp chunks, so each local query chunk skips
    the chunks after it, attends the ones before it whole and its own causally -- the same spans
    and kernels as the ring (``kernels``), so every rank does the same work."""
    hk, seq = k.shape[1], q.shape[2]
    kv = torch.cat([k, v], dim=1)
    if size > 1:
        kv = GatherSequence.apply(kv, group)
        pieces = kv.chunk(2 * size, dim=2)
        kv = torch.cat([pieces[i] for i in global_order(size)], dim=2)
    c = seq // 2
    k_spans = [(i * c, (i + 1) * c) for i in range(2 * size)]
    return SpanAttention.apply(q, kv[:, :hk], kv[:, hk:], local_spans(seq, size, rank), k_spans, scale)
