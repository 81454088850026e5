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
    sequence is put in global order, and each local query chunk attends to the prefix of keys it can
    see (its diagonal masked by global positions) -- so every rank does the same work."""
    hk = k.shape[1]
    kv = torch.cat([k, v], dim=1)
    if size > 1:
        kv = GatherSequence.apply(kv, group)
        pieces = kv.chunk(2 * size, dim=2)
        kv = torch.cat([pieces[i] for i in global_order(size)], dim=2)
    k_all, v_all = kv[:, :hk], kv[:, hk:]
    outs, q0 = [], 0
    for start, stop in local_spans(q.shape[2], size, rank):
        n = stop - start
        visible = (torch.arange(start, stop, device=q.device)[:, None] >= torch.arange(stop, device=q.device)[None, :])
        outs.append(F.scaled_dot_product_attention(q[:, :, q0:q0 + n], k_all[:, :, :stop], v_all[:, :, :stop],
                                                   attn_mask=visible, scale=scale, enable_gqa=hk != q.shape[1]))
        q0 += n
    return torch.cat(outs, dim=2)
