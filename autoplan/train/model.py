"""The model of a training run: a preset, an HF model type or a local config.json (or a directory).

No downloads: HF models come from ``transformers.AutoConfig.for_model`` (the installed package's
config classes) or a local ``config.json``. Every model is built on ``meta`` first (shapes only:
for planning, and for the Trainer, which applies the plan there and materialises only this rank's
shards); ``device=...`` makes a whole copy real with the seed's plan-independent initial values.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from autoplan.models.llama import build_llama
from autoplan.presets import UnknownPresetError, build_preset, get_preset, preset_config
from autoplan.train.errors import TrainConfigError
from autoplan.plan.pretrained import has_weights
from hyper_parallel.core.materialize import InitSources, default_init_fn, materialize

log = logging.getLogger(__name__)


def _hf_config(spec: str, layers: int | None, overrides: dict[str, Any]):
    import transformers

    path = Path(spec)
    if path.suffix == ".json" or path.is_dir():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise TrainConfigError(f"train: --model {spec!r}: no such config.json")
        data = json.loads(file.read_text())
        if "model_type" not in data:
            raise TrainConfigError(f"train: --model {spec!r}: config.json has no 'model_type'")
        cfg = transformers.AutoConfig.for_model(**{**data, **overrides})
    else:
        kind = spec.split(":", 1)[1]
        try:
            cfg = transformers.AutoConfig.for_model(kind, **overrides)
        except ValueError as e:
            raise TrainConfigError(f"train: --model {spec!r}: {str(e).splitlines()[0]}") from None
    if layers:   # the decoder's layers (a composite config's text_config)
        cfg.get_text_config().num_hidden_layers = layers
    return cfg


def build_model(spec: str, *, layers: int | None = None, overrides: dict[str, Any] | None = None,
                device: str | torch.device = "cpu", seed: int = 0) -> nn.Module:
    """``spec``: a preset name (``autoplan.presets.list_presets``), ``hf:<model_type>`` or a path
    to a local ``config.json`` (or a directory holding one). Built on meta; on another device the
    tensors are then made real with the seed's initial values -- the same values every plan's
    ranks materialise for their shards (``hyper_parallel.core.materialize``)."""
    model = _build_on_meta(spec, layers, dict(overrides or {}))
    if torch.device(device).type == "meta":
        return model
    return materialize(model, InitSources.of(model), default_init_fn(model), device=device, seed=seed)


def _build_on_meta(spec: str, layers: int | None, overrides: dict[str, Any]) -> nn.Module:
    if spec.startswith("hf:") or spec.endswith(".json") or Path(spec).is_dir():
        import transformers

        cfg = _hf_config(spec, layers, overrides)
        # a vision-language config (a ``vision_config`` beside its ``text_config``) trains its
        # image-text-to-text model: the tower and the decoder, as it was saved
        auto = transformers.AutoModelForImageTextToText if getattr(cfg, "vision_config", None) is not None \
            else transformers.AutoModelForCausalLM
        with torch.device("meta"):   # fp32 parameters (the optimizer's master copy) whatever dtype was saved
            return auto.from_config(cfg, dtype=torch.float32)
    try:
        preset = get_preset(spec)
    except UnknownPresetError as e:
        raise TrainConfigError(f"train: --model {spec!r}: {e.args[0]}; or use hf:<model_type> or a "
                               "config.json path") from None
    if preset.family == "titan":
        return build_llama(device="meta", **preset_config(spec, layers, **overrides).to_dict())
    return build_preset(spec, device="meta", num_layers=layers, **overrides)


def pretrained_weights(cfg) -> Path | None:
    """The directory whose safetensors the run starts from, or None (initialise from the seed).

    ``cfg.init``: ``auto`` -- a ``--model`` directory (or a config.json beside them) that holds
    weights is loaded, never silently replaced by a random init; ``pretrained`` -- weights are
    required; ``random`` -- initialise from the seed even where weights exist (said in the log)."""
    if cfg.init not in ("auto", "pretrained", "random"):
        raise TrainConfigError(f"train: --init {cfg.init!r}: use auto, pretrained or random")
    spec = Path(cfg.model)
    folder = spec if spec.is_dir() else spec.parent if spec.suffix == ".json" and spec.is_file() else None
    found = folder is not None and has_weights(folder)
    if cfg.init == "pretrained" and not found:
        raise TrainConfigError(f"train: --init pretrained: --model {cfg.model!r} is not a directory holding "
                               "*.safetensors weights (save_pretrained writes config.json + model.safetensors)")
    if cfg.init == "random":
        if found:
            log.warning("train: --init random: the weights in %s are not used", folder)
        return None
    if found and cfg.layers:
        raise TrainConfigError(f"train: --layers {cfg.layers} with the pretrained weights in {folder}: the "
                               "checkpoint holds every layer; drop --layers or pass --init random")
    return folder if found else None


def flops_per_token(model: nn.Module, seq: int) -> float:
    """Training FLOPs per token, PaLM's formula: 6 N + 12 L H Q T (N without the embedding table,
    L layers, H heads, Q head dim, T sequence length); what MFU is measured against."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg   # a VL model: its decoder's
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else getattr(model, "tok_embeddings", None)
    n = sum(p.numel() for p in model.parameters()) - (emb.weight.numel() if emb is not None else 0)
    layers = getattr(cfg, "n_layers", None) or getattr(cfg, "num_hidden_layers", 0)
    heads = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", 0)
    head_dim = getattr(cfg, "head_dim", None) or ((getattr(cfg, "hidden_size", 0) // heads) if heads else 0)
    return 6.0 * n + 12.0 * layers * heads * head_dim * seq
