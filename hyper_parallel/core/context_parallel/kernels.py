"""One block of attention between a query shard and a key/value shard, masked by global positions.

Why by hand and not SDPA: ring attention merges partial results of several key/value blocks, so
every block must also return the log-sum-exp of its scores, and its backward must be computable
from the *merged* output and log-sum-exp (flash attention's recomputation trick). SDPA's CPU
kernel returns neither in a form we can use on every device, so the few lines of math live here,
in fp32 whatever the input dtype.

Masking is by global positions: a shard is a list of *spans* (start, stop) of global positions
(two per rank in the load-balanced layout, ``layout.spans``), and each (query span, key span) pair
is either wholly visible (every query after every key: no mask), wholly hidden (skipped: no
compute) or on the diagonal (the causal mask ``q_pos >= k_pos``). Skipping hidden pairs is what
turns the load-balanced layout into equal work per rank; computing them masked would give every
rank cp full blocks. A query row with no visible key gets output 0 and log-sum-exp -inf, and
merges as "no contribution".

Shapes: q (b, h, sq, d); k, v (b, hk, sk, d) with h a multiple of hk (grouped-query attention:
query head j reads key/value head j // (h / hk), as transformers' ``repeat_kv``).

Fast path: on CPU, wholly visible pairs and square diagonal pairs (every diagonal pair of the
load-balanced layout) run torch's fused flash kernel, which returns the log-sum-exp and whose
backward takes the merged output and log-sum-exp -- 3-5x faster than the math on this machine.
Other devices and other pairs use the math below (``FUSED_CPU = False`` forces it; the tests run both).
"""
from __future__ import annotations

import torch

Spans = list[tuple[int, int]]   # global [start, stop) ranges, in local order


def _expand(kv: torch.Tensor, rep: int) -> torch.Tensor:
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _fold(grad: torch.Tensor, rep: int) -> torch.Tensor:
    """Sum the gradient of repeated key/value heads back onto their hk heads."""
    if rep == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // rep, rep, s, d).sum(2)


def _pairs(q_spans: Spans, k_spans: Spans):
    """(local q slice, local k slice, causal mask or None, square diagonal) for every visible pair
    of spans. ``square diagonal``: the same global range for queries and keys (the mask is exactly
    lower-triangular) -- decided from the spans, not the mask's values, so that the kernels also
    run under FakeTensorMode (verify's dry run), where a mask's values cannot be read."""
    out, q0 = [], 0
    for qa, qb in q_spans:
        k0 = 0
        for ka, kb in k_spans:
            qs, ks = slice(q0, q0 + qb - qa), slice(k0, k0 + kb - ka)
            if qa >= kb - 1:                    # every query at or after every key
                out.append((qs, ks, None, False))
            elif qb - 1 >= ka:                  # overlapping ranges: the causal diagonal
                q_pos, k_pos = torch.arange(qa, qb), torch.arange(ka, kb)
                out.append((qs, ks, q_pos[:, None] >= k_pos[None, :], qa == ka and qb == kb))
            k0 += kb - ka                       # else: every key after every query, hidden
        q0 += qb - qa
    return out


def _scores(q, k, mask, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask.to(s.device), float("-inf"))


def merge(out, lse, out_i, lse_i):
    """Combine two partial attentions over disjoint key sets by their log-sum-exps."""
    if out is None:
        return out_i, lse_i
    new = torch.logaddexp(lse, lse_i)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w, w_i = torch.exp(lse - safe).unsqueeze(-1), torch.exp(lse_i - safe).unsqueeze(-1)
    return out * w + out_i * w_i, new


FUSED_CPU = True


def _fused(q, k, mask, diagonal: bool) -> bool | None:
    """None: use the math; else the ``is_causal`` flag for torch's fused CPU flash kernel."""
    if not FUSED_CPU or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64, torch.bfloat16):
        return None
    if mask is None:
        return False
    return True if diagonal else None


def _dense_forward(q, k, v, mask, scale):
    s = _scores(q, k, mask, scale)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)   # fully masked rows: avoid inf - inf
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v.float()) / l.clamp_min(torch.finfo(torch.float32).tiny)
    return out, (m + torch.log(l)).squeeze(-1)


def block_forward(q, k, v, q_spans: Spans, k_spans: Spans, scale: float):
    """(out fp32 (b, h, sq, d), lse fp32 (b, h, sq)) of causal attention of q over this k/v block."""
    rep = q.shape[1] // k.shape[1]
    k, v = _expand(k, rep), _expand(v, rep)
    b, h, sq, d = q.shape
    out = torch.zeros(b, h, sq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, sq), float("-inf"), dtype=torch.float32, device=q.device)
    for qs, ks, mask, diagonal in _pairs(q_spans, k_spans):
        causal = _fused(q, k, mask, diagonal)
        if causal is None:
            o_i, l_i = _dense_forward(q[:, :, qs], k[:, :, ks], v[:, :, ks], mask, scale)
        else:
            o_i, l_i = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[:, :, qs], k[:, :, ks], v[:, :, ks], 0.0, causal, scale=scale)
            o_i, l_i = o_i.float(), l_i.float()
        out[:, :, qs], lse[:, :, qs] = merge(out[:, :, qs], lse[:, :, qs], o_i, l_i)
    return out, lse


def block_backward(q, k, v, q_spans: Spans, k_spans: Spans, scale: float, out, lse, dout, delta):
    """(dq, dk, dv) fp32 of this block's share of the merged attention, from the merged output
    ``out`` (in q's dtype), log-sum-exp ``lse`` and ``delta`` = rowsum(dout * out) (fp32); dk, dv on
    the hk key/value heads."""
    rep = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, rep), _expand(v, rep)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(ke.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(ve.shape, dtype=torch.float32, device=q.device)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    dout_in, dout = dout, dout.float()
    for qs, ks, mask, diagonal in _pairs(q_spans, k_spans):
        causal = _fused(q, ke, mask, diagonal)
        if causal is not None:
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout_in[:, :, qs].contiguous(), q[:, :, qs], ke[:, :, ks], ve[:, :, ks], out[:, :, qs], lse[:, :, qs],
                0.0, causal, scale=scale)
            dq[:, :, qs] += gq.float()
            dk[:, :, ks] += gk.float()
            dv[:, :, ks] += gv.float()
            continue
        s = _scores(q[:, :, qs], ke[:, :, ks], mask, scale)
        p = torch.exp(s - safe[:, :, qs].unsqueeze(-1))             # exact probabilities under the full softmax
        do = dout[:, :, qs]
        dv[:, :, ks] += torch.matmul(p.transpose(-1, -2), do)
        ds = p * (torch.matmul(do, ve[:, :, ks].float().transpose(-1, -2)) - delta[:, :, qs].unsqueeze(-1)) * scale
        dq[:, :, qs] += torch.matmul(ds, ke[:, :, ks].float())
        dk[:, :, ks] += torch.matmul(ds.transpose(-1, -2), q[:, :, qs].float())
    return dq, _fold(dk, rep), _fold(dv, rep)


class SpanAttention(torch.autograd.Function):
    """Causal attention of q over one k/v block by spans, with the hand-written backward above:
    the all-gather variant's local attention (the ring merges several blocks itself)."""

    @staticmethod
    def forward(ctx, q, k, v, q_spans: Spans, k_spans: Spans, scale: float):
        out, lse = block_forward(q, k, v, q_spans, k_spans, scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spans, ctx.scale = (q_spans, k_spans), scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        delta = (dout.float() * out.float()).sum(-1)
        dq, dk, dv = block_backward(q, k, v, *ctx.spans, ctx.scale, out, lse, dout, delta)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
