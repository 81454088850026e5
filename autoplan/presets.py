"""Model presets: public model shapes as configs only, built on meta (no weights, no downloads).

HF presets build from transformers config classes (an optional dependency, imported only when
such a preset is built); ``titan-*`` presets are the repo's own Llama at the same shapes.

    model = build_preset("llama3-70b")                # meta, 80 layers
    model = build_preset("llama3-405b", num_layers=8) # same shape, fewer layers
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from autoplan.errors import AutoplanError, InvalidArgumentError
from autoplan.models.llama import LlamaConfig, build_llama


class UnknownPresetError(AutoplanError, KeyError):
    """A preset name that is not in :func:`list_presets`."""


@dataclass(frozen=True)
class Preset:
    """``family``: "hf" (``config_class`` from transformers + ``auto_class``) or "titan" (repo Llama)."""

    name: str
    family: str
    config_class: str
    config: dict[str, Any]
    auto_class: str = "AutoModelForCausalLM"
    layers_key: str = "num_hidden_layers"
    extra_layer_keys: tuple[str, ...] = ()


def _llama(dim, ffn, layers, heads, kv, vocab=128256, theta=500000.0, **kw):
    return dict(hidden_size=dim, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv, vocab_size=vocab, rope_theta=theta, rms_norm_eps=1e-5,
                max_position_embeddings=8192, tie_word_embeddings=False, **kw)


def _titan(dim, ffn, layers, heads, kv, vocab=128256):
    return dict(dim=dim, ffn_hidden=ffn, n_layers=layers, n_heads=heads, n_kv_heads=kv, vocab_size=vocab,
                rope_theta=500000.0, max_seq_len=8192)


_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset("llama3-8b", "hf", "LlamaConfig", _llama(4096, 14336, 32, 32, 8)),
        Preset("llama3-70b", "hf", "LlamaConfig", _llama(8192, 28672, 80, 64, 8)),
        Preset("llama3-405b", "hf", "LlamaConfig", _llama(16384, 53248, 126, 128, 8)),
        Preset("llama2-7b", "hf", "LlamaConfig", _llama(4096, 11008, 32, 32, 32, vocab=32000, theta=10000.0)),
        Preset("mistral-7b", "hf", "MistralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, sliding_window=None)),
        Preset("qwen2-7b", "hf", "Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)),
        Preset("qwen2-72b", "hf", "Qwen2Config", dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False)),
        Preset("qwen3-8b", "hf", "Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)),
        Preset("qwen2-moe-a2.7b", "hf", "Qwen2MoeConfig", dict(hidden_size=2048, intermediate_size=5632,
               moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_hidden_layers=24,
               num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
               vocab_size=151936)),
        Preset("mixtral-8x7b", "hf", "MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
               num_experts_per_tok=2)),
        # openai/gpt-oss-20b config.json: 24 layers, 32 experts (top-4), alternating sliding/full attention
        Preset("gpt-oss-20b", "hf", "GptOssConfig", dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
               num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088, num_local_experts=32,
               num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072)),
        # deepseek-ai/DeepSeek-V3 config.json: 61 layers (first 3 dense), MLA, 256 routed experts (top-8, 8 groups,
        # top-4 groups) + 1 shared expert; 671B parameters (the MTP module is not modelled)
        Preset("deepseek-v3", "hf", "DeepseekV3Config", dict(hidden_size=7168, intermediate_size=18432,
               moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
               n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
               num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=129280,
               max_position_embeddings=163840, tie_word_embeddings=False)),
        Preset("phi3-mini", "hf", "Phi3Config", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32064)),
        Preset("gemma2-9b", "hf", "Gemma2Config", dict(hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
               num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000)),
        Preset("gpt2-xl", "hf", "GPT2Config", dict(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024),
               layers_key="n_layer"),
        Preset("opt-1.3b", "hf", "OPTConfig", dict(hidden_size=2048, ffn_dim=8192, num_hidden_layers=24,
               num_attention_heads=32, vocab_size=50272, max_position_embeddings=2048)),
        Preset("bert-large", "hf", "BertConfig", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
               intermediate_size=4096, vocab_size=30522), auto_class="AutoModelForMaskedLM"),
        Preset("t5-large", "hf", "T5Config", dict(d_model=1024, d_ff=4096, d_kv=64, num_layers=24, num_decoder_layers=24,
               num_heads=16, vocab_size=32128), auto_class="AutoModelForSeq2SeqLM", layers_key="num_layers",
               extra_layer_keys=("num_decoder_layers",)),
        Preset("vit-large", "hf", "ViTConfig", dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
               intermediate_size=4096, image_size=224, patch_size=16), auto_class="AutoModel"),
        Preset("titan-llama3-8b", "titan", "LlamaConfig", _titan(4096, 14336, 32, 32, 8), layers_key="n_layers"),
        Preset("titan-llama3-70b", "titan", "LlamaConfig", _titan(8192, 28672, 80, 64, 8), layers_key="n_layers"),
        Preset("titan-llama3-405b", "titan", "LlamaConfig", _titan(16384, 53248, 126, 128, 8), layers_key="n_layers"),
        # a few MB: what `autoplan train` and its tests run on a CPU
        Preset("titan-llama-debug", "titan", "LlamaConfig", _titan(128, 384, 4, 8, 4, vocab=256), layers_key="n_layers"),
    ]
}


def list_presets() -> list[str]:
    """Names accepted by :func:`build_preset`."""
    return sorted(_PRESETS)


def get_preset(name: str) -> Preset:
    try:
        return _PRESETS[name]
    except (KeyError, TypeError):
        raise UnknownPresetError(f"unknown preset {name!r}; known: {', '.join(list_presets())}") from None


def preset_config(name: str, num_layers: int | None = None, **overrides):
    """The preset's config object (a transformers config, or the repo's LlamaConfig)."""
    p = get_preset(name)
    values = {**p.config, **overrides}
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1):
        raise InvalidArgumentError(f"preset {name!r}: num_layers={num_layers!r} must be an integer >= 1 "
                                   f"(the preset has {p.config[p.layers_key]})")
    if num_layers is not None:
        for key in (p.layers_key, *p.extra_layer_keys):
            values[key] = num_layers
    if p.family == "titan":
        import dataclasses

        known = {f.name for f in dataclasses.fields(LlamaConfig)} if dataclasses.is_dataclass(LlamaConfig) else None
        if known is not None and set(overrides) - known:
            raise InvalidArgumentError(f"preset {name!r}: unknown config field(s) {sorted(set(overrides) - known)}; "
                                       f"known: {sorted(known)}")
        return LlamaConfig(**values)
    import transformers

    cls = getattr(transformers, p.config_class)
    unknown = sorted(k for k in overrides if not hasattr(cls(), k))
    if unknown:  # transformers keeps unknown keys as attributes nobody reads: refuse instead
        raise InvalidArgumentError(f"preset {name!r}: unknown config field(s) {unknown} for {p.config_class}")
    return cls(**values)


def build_preset(
    name: str,
    device: str | torch.device = "meta",
    num_layers: int | None = None,
    dtype: torch.dtype | None = None,
    **overrides,
) -> nn.Module:
    """Build preset ``name`` on ``device`` (meta by default: shapes only, no memory).

    ``num_layers`` overrides the depth (encoder and decoder for T5); other keyword arguments
    override config fields.
    """
    p = get_preset(name)
    cfg = preset_config(name, num_layers, **overrides)
    if p.family == "titan":
        model = build_llama(device=device, **cfg.to_dict())
    else:
        import transformers

        auto = getattr(transformers, p.auto_class)
        with torch.device(device):
            model = auto.from_config(cfg)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model


def use_fused_attention(model: nn.Module) -> nn.Module:
    """Capture ``model``'s attention as one fused kernel (torch's SDPA): every transformers config
    in it set to ``attn_implementation="sdpa"``, in place. For pricing and kernel profiles of what
    production runtimes run (Transformer Engine / cuDNN, FlashAttention, FlexAttention): a model left
    on transformers' "eager" attention (GPT-OSS's default, for its sinks) is captured as the two
    GEMMs and softmax that materialise the (s x s) scores, and priced so."""
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = "sdpa"
    return model
