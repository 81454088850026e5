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
import torch.nn.functional as F

from hyper_parallel.core.context_parallel.layout import positions_of_local


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
    """Causal attention of local q over the gathered keys/values (load-balanced layout)."""
    seq, hk = q.shape[2], k.shape[1]
    kv = GatherSequence.apply(torch.cat([k, v], dim=1), group) if size > 1 else torch.cat([k, v], dim=1)
    k_all, v_all = kv[:, :hk], kv[:, hk:]
    q_pos = positions_of_local(seq, size, rank, q.device)
    k_pos = torch.cat([positions_of_local(seq, size, r, q.device) for r in range(size)])
    visible = q_pos[:, None] >= k_pos[None, :]
    rep = q.shape[1] // hk
    if rep > 1:
        k_all, v_all = k_all.repeat_interleave(rep, dim=1), v_all.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=visible, scale=scale)
