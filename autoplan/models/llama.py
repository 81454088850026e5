"""A torchtitan-style Llama written in the repo: the model the whole project is tested on.

Module names follow torchtitan (tok_embeddings, layers.N.attention.wq, feed_forward.w1, norm,
output) so the public expert plans in shared/reference apply verbatim. RoPE uses real cos/sin
tables (no complex tensors) so the model runs on meta, fake and DTensor inputs alike; ``rope_complex``
rotates as torchtitan's code does (q and k viewed as complex pairs times a complex64 table), the same
rotation in other kernels -- what pricing torchtitan's own runs captures. Attention
infers local heads from the projected width (``view(b, s, -1, head_dim)``), which is what lets a
column-wise q/k/v projection work unchanged on a head shard.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hyper_parallel.core.materialize import InitSources, materialize


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 128
    ffn_hidden: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 64
    tie_embeddings: bool = False
    # torchtitan's rotary (view_as_complex, a complex multiply, view_as_real): the kernels its runs
    # launch -- eager, and compiled too, since inductor generates no complex code and falls back
    rope_complex: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def ffn_hidden_for(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
        """Llama's SwiGLU hidden size rule (2/3 of 4*dim, scaled, rounded up to multiple_of)."""
        hidden = int(2 * 4 * dim / 3)
        if ffn_dim_multiplier is not None:
            hidden = int(ffn_dim_multiplier * hidden)
        return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None, complex_form: bool = False) -> torch.Tensor:
    """(seq, head_dim) table: cos in the first half, sin in the second half of the last dim; or
    (``complex_form``) torchtitan's ``freqs_cis``, (seq, head_dim / 2) unit complex64 numbers."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    if complex_form:
        return torch.polar(torch.ones_like(freqs), freqs)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x: (b, s, h, d) by the angles in table: (s, d),
    or as torchtitan's ``apply_rotary_emb`` does where the table is complex (``rope_tables``)."""
    if table.is_complex():
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * table.view(1, x.shape[1], 1, -1)).flatten(3).type_as(x)
    half = table.shape[-1] // 2
    cos = table[:, :half].view(1, x.shape[1], 1, half)
    sin = table[:, half:].view(1, x.shape[1], 1, half)
    xr = x.float().reshape(*x.shape[:-1], half, 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    #: None: SDPA, causal. Context parallelism (hyper_parallel's ContextParallel style) sets a kernel
    #: ``(q, k, v) -> out`` on (batch, heads, seq, head_dim) tensors, k/v with their own (GQA) head count.
    attention_kernel = None

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        rope = rope[:seq]  # callers may pass a longer table (a pipeline stage sees a sequence shard)
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.attention_kernel is not None:  # un-repeated K/V heads: the kernel handles GQA
            out = self.attention_kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))
        rep = q.shape[2] // k.shape[2]  # grouped-query attention: query heads per KV head
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only transformer; ``forward(tokens) -> logits`` of shape (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer(
            "rope", rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, complex_form=cfg.rope_complex),
            persistent=False
        )

    def init_module(self, module: nn.Module) -> None:
        """Initialise ``module``'s own tensors (not its children's): RMSNorm weights 1, every other
        weight N(0, 0.02), the RoPE table of this model. Per module, so a model built on meta gets
        the same weights whatever plan shards it (``hyper_parallel.core.materialize``)."""
        with torch.no_grad():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
                return
            for p in module._parameters.values():
                if p is not None:
                    p.normal_(0.0, 0.02)
            if "rope" in module._buffers:
                module.rope.copy_(rope_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta,
                                              device=module.rope.device, complex_form=self.config.rope_complex))

    def init_weights(self, seed: int = 0) -> "Llama":
        """Deterministic random init, identical on every rank and under every plan for the same
        seed (each module seeded by its name: ``hyper_parallel.core.materialize``)."""
        device = self.rope.device if self.rope.device.type != "meta" else torch.device("cpu")
        materialize(self, InitSources.of(self), self.init_module, device=device, seed=seed)
        return self

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the global positions of the tokens (1-D, one per token) when they are not
        0..seq-1 -- a context-parallel shard holds a head and a tail chunk of the sequence."""
        h = self.tok_embeddings(tokens)
        seq = tokens.shape[1]
        rope = self.rope[:seq] if positions is None else self.rope[positions]
        for layer in self.layers.values():
            h = layer(h, rope)
        return self.output(self.norm(h))


def build_llama(seed: int = 0, device: str | torch.device = "cpu", **overrides) -> Llama:
    """A Llama from keyword overrides of LlamaConfig; random weights unless device is meta
    (built on meta either way, then materialised: the weights a plan's ranks get for the seed)."""
    cfg = LlamaConfig(**overrides)
    with torch.device("meta"):
        model = Llama(cfg)
    if str(device) != "meta":
        materialize(model, InitSources.of(model), model.init_module, device=device, seed=seed)
    return model
