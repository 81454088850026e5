"""transformers models under context parallelism: an attention function in transformers' registry.

transformers 5.x looks attention up by ``config._attn_implementation`` in ``AttentionInterface``
(``ALL_ATTENTION_FUNCTIONS``) on every call, so registering one function, ``hyper_parallel_cp``,
and pointing the model's config at it routes every attention layer through the cp kernel without
touching model code. The kernel for a layer is the one the ContextParallel style put on that
attention module (``_hp_cp_kernel``): one registry entry serves models on different meshes.

An implementation name that is not in transformers' *mask* registry makes ``create_causal_mask``
return None, so the function receives no mask and applies causality itself by global positions
(what the load-balanced layout needs); a padding mask would be dropped silently there, which is
why the style's input hook refuses an ``attention_mask`` that masks anything.
"""
from __future__ import annotations

from hyper_parallel.errors import LayoutError, UnsupportedModuleError

HF_ATTENTION_NAME = "hyper_parallel_cp"
KERNEL_ATTR = "_hp_cp_kernel"


def hf_cp_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                    is_causal=None, **kwargs):
    """transformers' attention-function signature: q, k, v (b, heads, s, d) -> ((b, s, heads, d), None)."""
    kernel = getattr(module, KERNEL_ATTR, None)
    name = type(module).__name__
    if kernel is None:
        raise UnsupportedModuleError(
            f"{HF_ATTENTION_NAME}: {name} has no context-parallel kernel; apply ContextParallel to the model "
            f"(apply_context_parallel) instead of setting attn_implementation by hand")
    if attention_mask is not None:
        raise LayoutError(f"{HF_ATTENTION_NAME} on {name}: got an attention mask; context parallel attention is causal "
                          f"over global positions and supports no padding or custom mask")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise LayoutError(f"{HF_ATTENTION_NAME} on {name}: non-causal attention is not supported")
    if dropout:
        raise LayoutError(f"{HF_ATTENTION_NAME} on {name}: attention dropout {dropout} is not supported (set "
                          f"config.attention_dropout = 0.0)")
    for unsupported in ("softcap", "sliding_window", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise LayoutError(f"{HF_ATTENTION_NAME} on {name}: {unsupported}={kwargs[unsupported]!r} is not supported")
    out = kernel(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


def register_hf_attention() -> None:
    """Put ``hyper_parallel_cp`` in transformers' attention registry (idempotent; at apply time,
    never at import)."""
    from transformers import AttentionInterface  # optional dependency, only for HF models

    AttentionInterface.register(HF_ATTENTION_NAME, hf_cp_attention)


def is_hf_model(module) -> bool:
    config = getattr(module, "config", None)
    return config is not None and hasattr(config, "_attn_implementation") and hasattr(module, "base_model_prefix")


def hf_attention_modules(module) -> list[tuple[str, object]]:
    """The attention layers transformers dispatches through the registry: modules named *Attention
    that carry ``is_causal`` and the shared config."""
    return [(fqn, m) for fqn, m in module.named_modules()
            if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal") and hasattr(m, "config")]


def hf_unsupported(module) -> str | None:
    """Why this HF model cannot run context parallel attention (None if it can)."""
    config = module.config
    if not getattr(config, "is_causal", True):
        return "config.is_causal is False (a bidirectional model); context parallelism here is causal only"
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        return f"config.layer_types has {other}; only full causal attention is supported"
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return f"config.sliding_window = {config.sliding_window}; sliding-window attention is not supported"
    if getattr(config, "attention_dropout", 0.0):
        return f"config.attention_dropout = {config.attention_dropout}; attention dropout is not supported"
    layers = hf_attention_modules(module)
    if not layers:
        return "no attention layer dispatching through transformers' AttentionInterface was found"
    for fqn, m in layers:
        if not m.is_causal:
            return f"{fqn}.is_causal is False; context parallelism here is causal only"
    return None
