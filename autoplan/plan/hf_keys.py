"""The names a transformers checkpoint stores a model's tensors under.

transformers 5 renames keys between a model and its files: ``save_pretrained`` of a LLaVA writes
``language_model.model.layers.0...`` for the model's ``model.language_model.layers.0...`` (the
layout its published checkpoints have), and ``from_pretrained`` renames them back. A loader that
reads files by the model's own names finds nothing, so a pretrained VL checkpoint would be
refused -- or, worse, half of it silently re-initialised. The renaming is transformers' own (its
conversion mapping for the model, applied as ``from_pretrained`` applies it); nothing is listed
here. Conversions that change tensors, not names (experts merged into one grouped weight), are
refused with the key that needs one: the loader reads slices of stored tensors and cannot merge.
"""
from __future__ import annotations

from typing import Callable

import torch.nn as nn

from autoplan.errors import PretrainedWeightsError


def file_to_model_names(model: nn.Module) -> Callable[[str], str]:
    """``rename(file key) -> the model's tensor name`` for ``model`` (the identity for a model
    transformers has no conversion mapping for, or no transformers model)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:   # an older transformers: its files carry the model's names
        return lambda key: key
    if not isinstance(model, PreTrainedModel):
        return lambda key: key
    transforms = get_model_conversion_mapping(model)
    if not transforms:
        return lambda key: key
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    names = dict.fromkeys(model.state_dict(keep_vars=True))
    prefix = getattr(model, "base_model_prefix", None) or None

    def rename(key: str) -> str:
        new, converted_by = rename_source_key(key, renamings, converters, prefix, names)
        if converted_by is not None:
            raise PretrainedWeightsError(
                f"pretrained weights: file tensor {key!r} becomes {new!r} through a conversion of its values "
                f"({converted_by!r}: transformers merges or splits such tensors on load); autoplan reads slices of "
                "stored tensors and cannot convert them -- load the model with from_pretrained once and save it "
                "with the model's own names (model.state_dict() into safetensors)", name=key)
        return new
    return rename
