"""Ring attention: keys/values travel around the cp ring, partial results merge by log-sum-exp.

Forward, cp steps: at step i rank r holds the key/value shard of rank (r - i) mod cp, computes its
block (masked by global positions, ``kernels``) and merges it; the next shard is already in flight
(one batched isend/irecv of [k|v] per step, cp - 1 messages: the exchange overlaps the block).
Backward (hand-written, flash-style from the saved output and log-sum-exp): the shards go round
again (cp - 1 messages of [k|v]) and with each one an accumulator of its gradient [dk|dv]: every
rank adds its contribution and passes it on, so after cp messages each accumulator is back home,
complete. Key/value heads travel un-repeated, so grouped-query attention sends hk, not h, heads.
Blocks compute in fp32; messages travel in the key/value dtype (the [dk|dv] accumulator too, so
bf16 keys accumulate their gradient in bf16 across ranks -- what ``predict`` prices).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_parallel.core.context_parallel.kernels import block_backward, block_forward, merge
from hyper_parallel.core.context_parallel.layout import local_spans


class _Ring:
    """The ring neighbours of this rank in ``group``, and one batched send/recv step."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)

    def start(self, buf: torch.Tensor):
        """Send ``buf`` to the next rank and receive the previous rank's; returns (recv buffer, requests)."""
        recv = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.group),
               dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending):
        recv, reqs = pending
        for r in reqs:
            r.wait()
        return recv


def _pack(k, v):
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf, shape):
    n = buf.numel() // 2
    return buf[:n].view(shape), buf[n:].view(shape)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, rank: int, size: int, scale: float):
        ring = _Ring(group, rank, size)
        seq = q.shape[2]
        q_spans = local_spans(seq, size, rank)
        cur = _pack(k.contiguous(), v.contiguous())
        out = lse = None
        for step in range(size):
            pending = ring.start(cur) if step < size - 1 else None
            src = (rank - step) % size
            k_i, v_i = _unpack(cur, k.shape)
            out_i, lse_i = block_forward(q, k_i, v_i, q_spans, local_spans(seq, size, src), scale)
            out, lse = merge(out, lse, out_i, lse_i)
            if pending is not None:
                cur = ring.wait(pending)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale = ring, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale = ctx.ring, ctx.scale
        rank, size, seq = ring.rank, ring.size, q.shape[2]
        q_spans = local_spans(seq, size, rank)
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        cur = _pack(k.contiguous(), v.contiguous())
        grad_pending = None
        for step in range(size):
            kv_pending = ring.start(cur) if step < size - 1 else None
            src = (rank - step) % size
            k_i, v_i = _unpack(cur, k.shape)
            dq_i, dk_i, dv_i = block_backward(q, k_i, v_i, q_spans, local_spans(seq, size, src), scale, out, lse,
                                              dout, delta)
            dq += dq_i
            acc = _pack(dk_i, dv_i).to(k.dtype)
            if grad_pending is not None:        # the accumulator of this shard, from the ranks before us
                acc = acc + ring.wait(grad_pending)
            grad_pending = ring.start(acc)
            if kv_pending is not None:
                cur = ring.wait(kv_pending)
        dk, dv = _unpack(ring.wait(grad_pending), k.shape)   # our own shard's gradient, complete
        return dq.to(q.dtype), dk.clone(), dv.clone(), None, None, None, None


def ring_attention(q, k, v, group, rank: int, size: int, scale: float) -> torch.Tensor:
    """Causal attention of local q over the keys/values of the whole cp ring (load-balanced layout)."""
    if size == 1:   # no ring: one device's causal attention
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=q.shape[1] != k.shape[1])
    return RingAttention.apply(q, k, v, group, rank, size, scale)
