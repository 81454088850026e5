"""A small mixture-of-experts Llama written in the repo, for tests, presets and benchmarks.

Blocks are the repo Llama's (RMSNorm, GQA attention with RoPE); the MLP of every layer from
``first_moe_layer`` on is a top-k MoE: a router (``router``, softmax over experts, top-k,
weights renormalised), an experts container ``experts`` called as ``experts(h, top_k_index,
top_k_weights)`` (transformers 5.x's protocol) holding either 3-D weights (``layout="stacked"``:
``gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]) or an ``nn.ModuleList`` of SwiGLU MLPs
(``layout="list"``), an optional shared expert, and the Switch-Transformer load-balancing loss
(``E * sum_e f_e * P_e``), which ``MoELlama.aux_loss()`` sums over layers after a forward.

The 3-D experts run as transformers' grouped path does: token copies sorted by expert, per-expert
offsets from a histogram (a fixed-size tensor), one ``autoplan::expert_mm`` call per projection.
The op hides the data-dependent per-expert slicing from tracing (its fake kernel says only the
output shape), so ``torch.export`` captures the layer -- the planner then recognises it as an MoE
layer and prices its top-k routed GEMM FLOPs (``capture.opcost``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.models.llama import Attention, FeedForward, LlamaConfig, RMSNorm, rope_tables


@dataclass(frozen=True)
class MoEConfig:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 64
    ffn_hidden: int = 64          # dense layers' MLP width
    moe_hidden: int = 16          # F: each expert's width
    n_experts: int = 8
    top_k: int = 2
    shared_expert: bool = True
    first_moe_layer: int = 0      # layers before it are dense (DeepSeek-V3's first_k_dense_replace)
    layout: str = "stacked"       # "stacked" (3-D weights) | "list" (ModuleList of experts)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 64

    def llama(self) -> LlamaConfig:
        return LlamaConfig(dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           vocab_size=self.vocab_size, ffn_hidden=self.ffn_hidden, norm_eps=self.norm_eps,
                           rope_theta=self.rope_theta, max_seq_len=self.max_seq_len)

    def to_dict(self) -> dict:
        return asdict(self)


@torch.library.custom_op("autoplan::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (expert e: rows ``offs[e-1]:offs[e]``) times ``weight[e].T``
    (``weight`` [E, out, in], F.linear's orientation): [rows, out]."""
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[e].t()
        start = end
    return out


@expert_mm.register_fake
def _(x, weight, offs):
    return x.new_empty(x.shape[0], weight.shape[1])


@torch.library.custom_op("autoplan::expert_mm_wgrad", mutates_args=())
def expert_mm_wgrad(grad: torch.Tensor, x: torch.Tensor, offs: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The weight gradient of :func:`expert_mm`: [E, out, in]."""
    out = grad.new_zeros(num_experts, grad.shape[1], x.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[e] = grad[start:end].t() @ x[start:end]
        start = end
    return out


@expert_mm_wgrad.register_fake
def _(grad, x, offs, num_experts):
    return grad.new_empty(num_experts, grad.shape[1], x.shape[1])


def _expert_mm_setup(ctx, inputs, output):
    x, weight, offs = inputs
    ctx.save_for_backward(x, weight, offs)


def _expert_mm_backward(ctx, grad):
    x, weight, offs = ctx.saved_tensors
    grad = grad.contiguous()
    dx = expert_mm(grad, weight.transpose(1, 2).contiguous(), offs) if ctx.needs_input_grad[0] else None
    dw = expert_mm_wgrad(grad, x, offs, weight.shape[0]) if ctx.needs_input_grad[1] else None
    return dx, dw, None


expert_mm.register_autograd(_expert_mm_backward, setup_context=_expert_mm_setup)


class StackedExperts(nn.Module):
    """E SwiGLU experts as two 3-D weights; a per-expert loop (the reference, as transformers')."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.num_experts = n_experts
        self.gate_up_proj = nn.Parameter(torch.randn(n_experts, 2 * hidden, dim) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(n_experts, dim, hidden) * 0.02)
        self.act_fn = F.silu

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._apply_gate(F.linear(x, self.gate_up_proj[e])), self.down_proj[e])

    def forward(self, hidden_states, top_k_index, top_k_weights):
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = counts.cumsum(0).to(torch.int64)
        token = order // k
        h = self._apply_gate(expert_mm(hidden_states[token], self.gate_up_proj, offs))
        y = expert_mm(h, self.down_proj, offs) * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add(0, token, y.to(hidden_states.dtype))


class ListExperts(nn.Module):
    """E SwiGLU experts as an nn.ModuleList (the older layout)."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.mlps = nn.ModuleList(FeedForward(dim, hidden) for _ in range(n_experts))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return _loop(lambda e, x: self.mlps[e](x), len(self.mlps), hidden_states, top_k_index, top_k_weights)


def _loop(expert, n_experts: int, hidden, top_k_index, top_k_weights):
    out = torch.zeros_like(hidden)
    for e in range(n_experts):
        token, slot = torch.where(top_k_index == e)
        if token.numel():
            out.index_add_(0, token, expert(e, hidden[token]) * top_k_weights[token, slot, None])
    return out


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k, self.n_experts = cfg.top_k, cfg.n_experts
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        cls = {"stacked": StackedExperts, "list": ListExperts}.get(cfg.layout)
        if cls is None:
            raise ValueError(f"MoEConfig.layout: {cfg.layout!r} is not one of 'stacked', 'list'")
        self.experts = cls(cfg.n_experts, cfg.dim, cfg.moe_hidden)
        self.shared_expert = FeedForward(cfg.dim, cfg.moe_hidden) if cfg.shared_expert else None
        self.aux_loss = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = x.reshape(-1, d)
        probs = F.softmax(self.router(h).float(), dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        frac = F.one_hot(index, self.n_experts).float().sum(1).mean(0) / self.top_k  # f_e
        self.aux_loss = self.n_experts * (frac * probs.mean(0)).sum()
        out = self.experts(h, index, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(h)
        return out.view(b, s, d)


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig, moe: bool):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg.llama())
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg) if moe else FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class MoELlama(nn.Module):
    """``forward(tokens) -> logits``; ``aux_loss()`` after a forward."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(cfg, i >= cfg.first_moe_layer) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("rope", rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        rope = self.rope[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h))

    def aux_loss(self) -> torch.Tensor:
        return sum((m.aux_loss for m in self.modules() if isinstance(m, MoE)), torch.zeros(()))


def build_moe(seed: int = 0, device: str | torch.device = "cpu", **overrides) -> MoELlama:
    """An MoELlama from keyword overrides of MoEConfig; weights random (std 0.02, norms 1) unless on meta."""
    cfg = MoEConfig(**overrides)
    with torch.device(device):
        model = MoELlama(cfg)
    if str(device) != "meta":
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.ones(p.shape) if name.endswith("norm.weight") else torch.randn(p.shape, generator=gen)
                        * 0.02)
        model.rope = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
    return model
