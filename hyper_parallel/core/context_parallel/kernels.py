"""One block of attention between a query shard and a key/value shard, masked by global positions.

Why by hand and not SDPA: ring attention merges partial results of several key/value blocks, so
every block must also return the log-sum-exp of its scores, and its backward must be computable
from the *merged* output and log-sum-exp (flash attention's recomputation trick). SDPA's CPU
kernel returns neither in a form we can use on every device, so the few lines of math live here,
in fp32 whatever the input dtype. The causal mask is ``q_pos >= k_pos`` on global positions, which
is what makes the load-balanced layout (non-contiguous chunks) exact. A query row with no visible
key in a block (a head chunk against a later rank's keys) gets output 0 and log-sum-exp -inf, and
merges as "no contribution".

Shapes: q (b, h, sq, d); k, v (b, hk, sk, d) with h a multiple of hk (grouped-query attention:
query head j reads key/value head j // (h / hk), as transformers' ``repeat_kv``).
"""
from __future__ import annotations

import torch


def _expand(kv: torch.Tensor, rep: int) -> torch.Tensor:
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)


def _fold(grad: torch.Tensor, rep: int) -> torch.Tensor:
    """Sum the gradient of repeated key/value heads back onto their hk heads."""
    if rep == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // rep, rep, s, d).sum(2)


def _scores(q, k, q_pos, k_pos, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    visible = q_pos[:, None] >= k_pos[None, :]
    return s.masked_fill(~visible, float("-inf")), visible


def block_forward(q, k, v, q_pos, k_pos, scale: float):
    """(out fp32 (b, h, sq, d), lse fp32 (b, h, sq)) of causal attention of q over this k/v block."""
    rep = q.shape[1] // k.shape[1]
    k, v = _expand(k, rep), _expand(v, rep)
    s, _ = _scores(q, k, q_pos, k_pos, scale)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)   # fully masked rows: avoid inf - inf
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    out = torch.matmul(p, v.float()) / l.clamp_min(torch.finfo(torch.float32).tiny)
    lse = (m + torch.log(l)).squeeze(-1)                        # -inf where nothing is visible
    return out, lse


def merge(out, lse, out_i, lse_i):
    """Combine two partial attentions over disjoint key sets by their log-sum-exps."""
    if out is None:
        return out_i, lse_i
    new = torch.logaddexp(lse, lse_i)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w, w_i = torch.exp(lse - safe).unsqueeze(-1), torch.exp(lse_i - safe).unsqueeze(-1)
    return out * w + out_i * w_i, new


def block_backward(q, k, v, q_pos, k_pos, scale: float, lse, dout, delta):
    """(dq, dk, dv) of this block's share of the merged attention, from the merged log-sum-exp
    ``lse`` and ``delta`` = rowsum(dout * out); dk, dv on the hk key/value heads."""
    rep = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, rep), _expand(v, rep)
    s, visible = _scores(q, ke, q_pos, k_pos, scale)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe.unsqueeze(-1)) * visible                 # exact probabilities under the full softmax
    dout = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, ve.float().transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1)) * scale
    dq = torch.matmul(ds, ke.float())
    dk = torch.matmul(ds.transpose(-1, -2), q.float())
    return dq, _fold(dk, rep), _fold(dv, rep)
