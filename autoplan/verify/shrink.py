"""A small copy of a model for checking a plan's numerics on a few CPU ranks.

A plan made for a 70B model cannot be run on this CPU, but its *styles* can: the same
architecture with small widths runs the same code paths -- the same module names, the same
reshapes by head count, the same norms, the same fused projections. What must survive the
shrinking is every fact a style depends on: the number of heads and KV heads, and whether each
sharded width (vocabulary, MLP hidden, experts) is divisible by the tensor-parallel degree.
So head counts are kept, the head dimension is made small, and every other width keeps its
residue modulo the plan's degrees (a vocabulary of 128257 at tp=4 stays one more than a
multiple of 4).

``ModelRecipe`` is the picklable description the ranks rebuild the model from: an HF config
(as a dict) or an importable factory with keyword arguments. Every parameter of the rebuilt
model is perturbed from its initialisation (seeded), so zero biases and unit norm weights cannot
hide a wrong gradient.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from autoplan.errors import PlanningError

HEAD_DIM = 8          # per-head width of the small copy (even: rotary embeddings pair dimensions)
LAYERS = 2            # repeated blocks kept per stack
BASE_WIDTH = 16       # multiple (times the degrees) every shrunk width starts from
# attention windows and chunks of the small copy: shorter than the sequences it is checked on
# (numerics: 16 tokens), so a runtime that drops a window (a mask, a chunk) shows as a difference
WINDOW = 8


@dataclass(frozen=True)
class ModelRecipe:
    """How every rank builds the same model: ``hf_config`` (``config.to_dict()`` plus
    ``model_class``) or ``factory`` ("package.module:function") called with ``kwargs``."""

    hf_config: dict | None = None
    factory: str | None = None
    kwargs: dict = field(default_factory=dict)
    seed: int = 0
    perturb: float = 0.05

    def build(self, device: str = "cpu") -> nn.Module:
        torch.manual_seed(self.seed)
        if self.hf_config is not None:
            model = _build_hf(self.hf_config, device)
        elif self.factory is not None:
            model = _resolve(self.factory)(**self.kwargs)
            model = model.to(device) if device != "meta" else model
        else:
            raise PlanningError("ModelRecipe: give hf_config= or factory=")
        if self.perturb and device != "meta":
            perturb_parameters(model, self.seed, self.perturb)
        return model


def perturb_parameters(model: nn.Module, seed: int, scale: float) -> None:
    """Every parameter gets seeded noise added (norm weights 1 -> 1 +- scale, biases 0 -> +-scale),
    so no parameter's gradient is trivially zero or symmetric across ranks."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * scale)


def _resolve(path: str) -> Callable:
    mod, _, name = path.partition(":")
    if not name:
        raise PlanningError(f"ModelRecipe: factory {path!r} must be 'package.module:function'")
    return getattr(importlib.import_module(mod), name)


def _build_hf(cfg: dict, device: str) -> nn.Module:
    import transformers

    cfg = dict(cfg)
    model_cls = getattr(transformers, cfg.pop("model_class"))
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config._attn_implementation = "eager"  # every family has it; the plan's styles do not depend on it
    with torch.device(device):
        return model_cls(config)


def _keep_residue(width: int, degrees: list[int]) -> int:
    """A small width with the same residue as ``width`` modulo every degree's lcm."""
    m = math.lcm(*degrees) if degrees else 1
    return BASE_WIDTH * m + width % m


_HEAD_KEYS = ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "encoder_attention_heads",
              "decoder_attention_heads", "num_heads", "n_head", "n_heads", "attention_heads")
_WIDTH_KEYS = ("intermediate_size", "ffn_hidden_size", "n_inner", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim",
               "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size")
# widths a model compares with its hidden size (OPT adds project_in / project_out only when
# word_embed_proj_dim differs): equal to the small hidden size where equal in the real config
_HIDDEN_TWINS = ("word_embed_proj_dim",)
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers",
               "decoder_layers", "n_layers")


def _sub_configs(config: Any) -> dict[str, Any]:
    """The sub-models' configs of a composite config (a VL model's ``text_config`` and
    ``vision_config``): every attribute named ``*_config`` that is a config itself."""
    d = config.to_dict()
    return {k: getattr(config, k) for k in d if k.endswith("_config") and hasattr(getattr(config, k, None), "to_dict")}


def _shrink_composite(config: Any, subs: dict[str, Any], degrees: list[int]) -> dict:
    """Each sub-model shrunk as a model of its own; a top-level width that names a sub-model's
    hidden size (PaliGemma's ``projection_dim``, a ``hidden_size`` mirrored at the top) follows it."""
    out = dict(config.to_dict())
    follow: dict[int, int] = {}
    for key, sub in subs.items():
        # windows are shrunk in the text model only (a vision tower's windows are in pixels)
        small = shrink_hf_config(sub, degrees, extents=key == "text_config")
        small.pop("model_class", None)
        old = next((sub.to_dict()[k] for k in ("hidden_size", "d_model", "n_embd") if k in sub.to_dict()), None)
        new = next((small[k] for k in ("hidden_size", "d_model", "n_embd") if k in small), None)
        if isinstance(old, int) and isinstance(new, int) and key == "text_config":
            follow[old] = new
        elif isinstance(old, int) and isinstance(new, int):
            follow.setdefault(old, new)
        out[key] = small
    text_hidden = {old: new for old, new in follow.items() if new == next(
        (out["text_config"].get(k) for k in ("hidden_size", "d_model", "n_embd") if k in out.get("text_config", {})), None)}
    for table, names in [(out, follow)] + [(out[k], text_hidden) for k in subs if k != "text_config"]:
        for k, v in list(table.items()):   # Qwen-VL's vision out_hidden_size feeds the decoder
            if isinstance(v, int) and not isinstance(v, bool) and v in names and any(
                    w in k for w in ("hidden", "dim", "size")) and not (table is not out and k == "hidden_size"):
                table[k] = names[v]
    text = out.get("text_config")
    ids = [v for k, v in out.items() if "token" in k and isinstance(v, int) and not isinstance(v, bool)]
    if isinstance(text, dict) and isinstance(text.get("vocab_size"), int) and ids and max(ids) >= text["vocab_size"]:
        # the image token must stay an id the small vocabulary embeds: grow it by whole lcm steps
        step = math.lcm(*degrees) if degrees else 1
        text["vocab_size"] += step * math.ceil((max(ids) + 1 - text["vocab_size"]) / step)
    return _without_noise(out)


def _without_noise(out: dict) -> dict:
    """``out`` with every dropout probability 0 and the file's provenance keys dropped."""
    for k in list(out):
        if ("dropout" in k or k.endswith("pdrop")) and isinstance(out[k], float):
            out[k] = 0.0
    out.pop("architectures", None)
    out.pop("transformers_version", None)
    return out


def _mrope_sections(d: dict) -> dict:
    """M-RoPE's per-axis split of the rotary half (Qwen-VL's ``mrope_section``, summing to
    head_dim / 2) rescaled to the small head dim, each axis keeping at least one pair."""
    out = {}
    for key in ("rope_scaling", "rope_parameters"):
        rope = d.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and sum(rope["mrope_section"]):
            sec, want = rope["mrope_section"], HEAD_DIM // 2
            new = [max(1, want * s // sum(sec)) for s in sec]
            while sum(new) > want:
                new[new.index(max(new))] -= 1
            while sum(new) < want:
                new[new.index(min(new))] += 1
            out[key] = dict(rope, mrope_section=new)
    return out


def shrink_hf_config(config: Any, degrees: list[int], extents: bool = True) -> dict:
    """The small config (as a dict) of an HF ``config``: heads kept, head dim ``HEAD_DIM``, widths
    small with their residues modulo ``degrees`` kept, ``LAYERS`` blocks per stack, no dropout,
    attention windows and chunks shorter than the check's sequences (``extents``). A composite
    config (no head count of its own, sub-models' configs) shrinks each sub-model."""
    d = config.to_dict()
    subs = _sub_configs(config)
    if subs and not any(isinstance(d.get(k), int) for k in _HEAD_KEYS):
        return _shrink_composite(config, subs, degrees)
    out = dict(d)
    heads = next((d[k] for k in ("num_attention_heads", "encoder_attention_heads", "num_heads", "n_head", "n_heads",
                                 "attention_heads") if isinstance(d.get(k), int)), None)
    if heads is None:
        raise PlanningError(f"shrink: {type(config).__name__} names no attention head count")
    hidden_key = next(k for k in ("hidden_size", "d_model", "n_embd") if k in d)
    old_hidden = d[hidden_key]
    head_dim = d.get("head_dim") or d.get("d_kv") or old_hidden // heads
    out[hidden_key] = heads * HEAD_DIM
    if d.get("head_dim"):
        out["head_dim"] = HEAD_DIM
    if "d_kv" in d:
        out["d_kv"] = HEAD_DIM
    if "query_pre_attn_scalar" in d:
        out["query_pre_attn_scalar"] = HEAD_DIM
    for k in _WIDTH_KEYS:
        if isinstance(d.get(k), int) and d[k] > 0:
            out[k] = _keep_residue(d[k], degrees)
    for k in _HIDDEN_TWINS:
        if isinstance(d.get(k), int):
            out[k] = out[hidden_key] if d[k] == old_hidden else _keep_residue(d[k], degrees)
    for k in _LAYER_KEYS:
        if isinstance(d.get(k), int):
            out[k] = min(d[k], LAYERS)
    for k in ("layer_types",):
        if isinstance(d.get(k), list):
            n = out.get("num_hidden_layers", LAYERS)
            out[k] = d[k][:n]
    for k in ("num_local_experts", "num_experts", "n_routed_experts"):
        if isinstance(d.get(k), int):
            out[k] = min(d[k], 4)
    if isinstance(d.get("n_group"), int) and d["n_group"] > 1:   # group-limited routing over the kept experts
        out["n_group"], out["topk_group"] = 1, 1
    if isinstance(d.get("kv_lora_rank"), int):
        out.update(_shrink_latent(d))
    if isinstance(d.get("num_experts_per_tok"), int):
        experts = next((out[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if k in out), 4)
        out["num_experts_per_tok"] = min(d["num_experts_per_tok"], experts)
    for name, sub in d.items():   # widths and expert counts in a nested block config (DBRX's ffn_config)
        if isinstance(sub, dict) and isinstance(sub.get("ffn_hidden_size"), int):
            small = dict(sub, ffn_hidden_size=_keep_residue(sub["ffn_hidden_size"], degrees))
            if isinstance(sub.get("moe_num_experts"), int):
                small["moe_num_experts"] = min(sub["moe_num_experts"], 4)
                small["moe_top_k"] = min(int(sub.get("moe_top_k") or 1), small["moe_num_experts"])
            out[name] = small
    for k, v in attention_extents(d).items():
        if extents and v > WINDOW and "." not in k:   # nested configs (composite models) are not shrunk here
            out[k] = WINDOW
    out.update(_mrope_sections(d))
    if "max_position_embeddings" in d:
        out["max_position_embeddings"] = max(64, min(d["max_position_embeddings"], 512))
    if "n_positions" in d:
        out["n_positions"] = 64
    if head_dim and "partial_rotary_factor" not in d and d.get("rotary_dim"):
        out["rotary_dim"] = HEAD_DIM
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "forced_eos_token_id"):
        v = out.get(k)
        if isinstance(v, int) and v >= out.get("vocab_size", 1 << 30):
            out[k] = 0
    return _without_noise(out)


def _is_extent_key(key: str) -> bool:
    """Config keys holding an attention window or chunk length (``sliding_window``,
    ``attention_chunk_size``, ``chunk_size``, ...), not layer counts or patterns that share the
    words (Qwen2's ``max_window_layers``, ``sliding_window_pattern``)."""
    k = key.lower()
    return ("window" in k or "chunk" in k) and not any(w in k for w in ("layers", "pattern", "feed_forward"))


def attention_extents(d: dict) -> dict[str, int]:
    """Every positive int-valued window/chunk setting of a config dict (nested configs as
    ``text_config.sliding_window``): the lengths a sequence must exceed for a check to see them."""
    out: dict[str, int] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in attention_extents(v).items()})
        elif isinstance(v, int) and not isinstance(v, bool) and v > 0 and _is_extent_key(k):
            out[k] = v
    return out


def _shrink_latent(d: dict) -> dict:
    """A latent attention's widths (DeepSeek's MLA): per-head nope/v widths ``HEAD_DIM``, the rotary
    width half of it (``head_dim`` is the rotary width there), small latents. The latents and the
    rotary key are replicated when heads are sharded, so no residue needs keeping."""
    rope = HEAD_DIM // 2
    out = {"qk_nope_head_dim": HEAD_DIM, "v_head_dim": HEAD_DIM, "qk_rope_head_dim": rope, "head_dim": rope,
           "qk_head_dim": HEAD_DIM + rope, "kv_lora_rank": BASE_WIDTH}
    if isinstance(d.get("q_lora_rank"), int):
        out["q_lora_rank"] = 2 * BASE_WIDTH
    return out


def recipe_for(model: nn.Module, degrees: list[int], seed: int = 0) -> ModelRecipe:
    """The small-copy recipe of ``model``: from its HF config when it has one."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not getattr(config, "model_type", None):
        raise PlanningError(
            f"verify(numerics=True): {type(model).__name__} has no Hugging Face config to shrink; "
            f"pass factory='package.module:function' (and factory_kwargs) that builds a small copy")
    cfg = shrink_hf_config(config, degrees)
    cfg["model_class"] = type(model).__name__
    cfg["model_type"] = config.model_type
    return ModelRecipe(hf_config=cfg, seed=seed)
