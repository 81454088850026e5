"""A Megatron-LM (2021) style GPT written in the repo: the model of the published Megatron runs.

Why a second model: the Megatron-LM SC'21 and Korthikanti et al. runs (shared/reference/
published_runs.json) trained GPT blocks -- pre-LayerNorm, biases, a 4h GeLU MLP, tied input/output
embeddings, dropout 0.1 on the attention probabilities and on both residual branches, and
*unfused* attention (scores, scaled masked softmax and dropout materialised as (b, a, s, s)
tensors; FlashAttention came in 2022). Pricing those runs with a Llama block would drop the
memory-bound attention core that costs them a large share of the step. Module names follow the repo's Llama (tok_embeddings,
layers.N.attention.wq, feed_forward.w1/w2, norm, output) so the planner's roles and the expert
plans apply unchanged.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F



@dataclass(frozen=True)
class GPTConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 128
    ffn_hidden: int = 256
    norm_eps: float = 1e-5
    dropout: float = 0.1
    max_seq_len: int = 64
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(nn.Module):
    """Multi-head attention computed the Megatron-2021 way: bmm, scaled causal-masked softmax,
    dropout on the probabilities, bmm (no fused kernel)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim, self.p = cfg.head_dim, cfg.dropout
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bs, seq, -1, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        mask = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        probs = F.dropout(torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1), self.p, self.training)
        out = torch.matmul(probs, v)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """GeLU MLP with biases: w2(gelu(w1 x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.p = cfg.dropout
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + F.dropout(self.attention(self.attention_norm(x)), self.p, self.training)
        return h + F.dropout(self.feed_forward(self.ffn_norm(h)), self.p, self.training)


class GPT(nn.Module):
    """Decoder-only GPT; ``forward(tokens) -> logits`` of shape (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # learned absolute positions as in Megatron; a buffer, so the parameter count stays the
        # reference's (its 'params' leave the position table out)
        self.register_buffer("positions", torch.zeros(cfg.max_seq_len, cfg.dim), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.positions[:tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def build_gpt(device: str | torch.device = "meta", **overrides) -> GPT:
    """A GPT from keyword overrides of GPTConfig (meta by default: for planning)."""
    cfg = GPTConfig(**overrides)
    with torch.device(device):
        return GPT(cfg)
