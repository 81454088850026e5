"""Models the planner tests use: the repo Llama and HF Llama / Qwen2 built from config (meta or
random weights), at real shapes with few layers (the per-layer trade-offs do not depend on depth)."""
from __future__ import annotations

import torch
import torch.nn as nn

from autoplan.models import build_llama


def repo_llama_8b(layers: int = 4, device: str = "meta", **kw):
    return build_llama(device=device, dim=4096, n_layers=layers, n_heads=32, n_kv_heads=8, vocab_size=128256,
                       ffn_hidden=14336, max_seq_len=8192, **kw)


def hf_model(kind: str, device: str = "meta", seed: int = 0, **cfg):
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel)}[kind]
    config = cls[0](**cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        return cls[1](config)


def hf_llama_8b(layers: int = 2):
    return hf_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)


def hf_qwen2_72b(layers: int = 2):
    return hf_model("qwen2", hidden_size=8192, intermediate_size=29568, num_hidden_layers=layers,
                    num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, max_position_embeddings=8192)


def hf_qwen2_7b(layers: int = 2):
    return hf_model("qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                    num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, max_position_embeddings=8192)


def hf_gpt3_175b(layers: int = 2):
    """GPT-3 175B's shape in GPT-2's architecture (fused [q|k|v] Conv1D, GeLU MLP, tied embeddings),
    vocabulary padded as Megatron pads it (to a multiple of 128 * tp)."""
    return hf_model("gpt2", n_embd=12288, n_head=96, n_layer=layers, n_inner=4 * 12288, vocab_size=51200,
                    n_positions=2048)


class GlobalHeadsAttention(nn.Module):
    """Reshapes by the *global* head count (as StableLM does): wrong on a head shard unless the
    count is made local. ``count_name``: the attribute holding it ("heads" says what it is; "n"
    does not, so the planner cannot know to make it local)."""

    def __init__(self, dim=256, heads=8, count_name="heads"):
        super().__init__()
        self.count_name, self.hd = count_name, dim // heads
        setattr(self, count_name, heads)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        heads = getattr(self, self.count_name)
        q, k, v = (p(x).view(b, s, heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self, dim=256, count_name="heads"):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = GlobalHeadsAttention(dim, count_name=count_name)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=512, dim=256, layers=2, count_name="heads"):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, count_name) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
