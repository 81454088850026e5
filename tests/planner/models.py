"""Models the planner tests use: the repo Llama and HF Llama / Qwen2 built from config (meta or
random weights), at real shapes with few layers (the per-layer trade-offs do not depend on depth)."""
from __future__ import annotations

import torch

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
