"""The keys an attention core lets each query see: a sliding window (Mistral, Gemma-2/3's local
layers, GPT-OSS's banded layers, Qwen2/3 with ``use_sliding_window``) or a chunk (Llama-4's
chunked layers), read per module as the model's code uses it -- not from the model's config in
general, so a Gemma-3 local layer and its global neighbour get their own.

Where it is read, in order:

- the attention module's ``sliding_window`` attribute: transformers sets it per layer
  (``config.sliding_window if layer_type == "sliding_attention" else None``) and passes it to the
  attention interface (flash / flex read it; SDPA and eager get the same band as the per-layer-type
  mask ``create_sliding_window_causal_mask`` builds from it, ``kv_idx > q_idx - window``);
- else, for a model with one window on every layer (no ``layer_types``: Mistral, Mixtral, Phi-3,
  Starcoder2), the config's ``sliding_window`` its attention passes at each call;
- else the layer type the model's forward picks this layer's mask by
  (``causal_mask_mapping[config.layer_types[layer_idx]]``, Llama-4): ``chunked_attention`` with
  ``attention_chunk_size`` (``create_chunked_causal_mask``, ``kv // chunk == q // chunk``), or
  ``sliding_attention`` with ``sliding_window`` for a family whose module holds no window.

On meta the mask tensor has no values, so the mask itself cannot be read at capture; these are
the two inputs transformers builds it from. A module with neither sees every earlier key.
"""
from __future__ import annotations

import torch.nn as nn

WINDOW = "window"   # each query sees at most the last ``span`` keys (itself included)
CHUNK = "chunk"     # each query sees the earlier keys of its own ``span``-long chunk


def key_span(module: nn.Module) -> tuple[str, int] | tuple[()]:
    """(WINDOW or CHUNK, length) of ``module``'s attention, or () for full (causal) attention."""
    own = vars(module)   # plain attributes only: nn.Module's __getattr__ fallback is slow on a miss
    w = own.get("sliding_window")
    if _length(w):
        return (WINDOW, int(w))
    idx = own.get("layer_idx")
    config = own.get("config")
    types = getattr(config, "layer_types", None) if config is not None else None
    if types is None and isinstance(idx, int) and _length(getattr(config, "sliding_window", None)) \
            and getattr(config, "use_sliding_window", True) is not False:
        # one window on every layer, passed from the config at each call (Mistral, Mixtral,
        # Phi-3, Starcoder2: ``sliding_window=getattr(self.config, "sliding_window", None)``)
        return (WINDOW, int(config.sliding_window))
    if not isinstance(idx, int) or not isinstance(types, (list, tuple)) or not 0 <= idx < len(types):
        return ()
    kind = types[idx]
    if kind == "chunked_attention" and _length(getattr(config, "attention_chunk_size", None)):
        return (CHUNK, int(config.attention_chunk_size))
    if kind == "sliding_attention" and _length(getattr(config, "sliding_window", None)):
        return (WINDOW, int(config.sliding_window))
    return ()


def _length(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
