"""The names a transformers checkpoint stores a model's tensors under.

transformers 5 renames keys between a model and its files: ``save_pretrained`` of a LLaVA writes
``language_model.model.layers.0...`` for the model's ``model.language_model.layers.0...`` (the
layout its published checkpoints have), and ``from_pretrained`` renames them back. A loader that
reads files by the model's own names finds nothing, so a pretrained VL checkpoint would be
refused -- or, worse, half of it silently re-initialised. The renaming is transformers' own (its
conversion mapping for the model, applied as ``from_pretrained`` applies it); nothing is listed
here.

Some conversions change values, not only names: every MoE family's files hold one 2-D tensor per
expert (``mlp.experts.3.gate_proj.weight``) where the model holds one fused 3-D weight
(``mlp.experts.gate_up_proj``), built by the converter's ``MergeModulelist`` (stack the experts)
and ``Concatenate`` (gate | up). Those two only *place* whole file tensors into boxes of the model
tensor, so a rank can still read just the bytes it holds: such a key comes back with its
:class:`MergeSlot` (the converter, the source pattern it matched, its module-list index) and
:mod:`autoplan.plan.hf_merged` lays the pieces out from the converter itself. Any other operation
(a transpose, a chunk, a RoPE permutation, an interleave, a dequantisation) would need the whole
tensor's values: those keys are refused with the key and the converter.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from autoplan.errors import PretrainedWeightsError


@dataclass(frozen=True)
class MergeSlot:
    """Where a file tensor goes in a model tensor that transformers assembles from several."""

    converter: object        # transformers' WeightConverter (its source patterns and operations)
    pattern: str             # the converter's source pattern this key matched
    index: int | None        # the module-list index the pattern's ``*`` matched (None: no ``*``)


KeyTarget = tuple[str, "MergeSlot | None"]


def placing_ops() -> tuple[type, ...]:
    """The conversion operations that only place whole file tensors (see module doc)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist
    return (MergeModulelist, Concatenate)


def _refuse(key: str, new: str, converter, why: str) -> PretrainedWeightsError:
    return PretrainedWeightsError(
        f"pretrained weights: file tensor {key!r} becomes {new!r} through a conversion of its values "
        f"({converter!r}: {why}); autoplan reads slices of stored tensors and places them (MergeModulelist, "
        "Concatenate) but does not compute new values -- load the model with from_pretrained once and save it "
        "with the model's own names (model.state_dict() into safetensors)", name=key)


def _index(key: str, pattern: str) -> int | None:
    """The module-list index ``*`` stands for in ``key`` (a pattern matched after the renamings)."""
    if "*" not in pattern:
        return None
    rx = re.escape(pattern.lstrip("^")).replace(r"\*", r"(\d+)")
    m = re.search(rx, key)
    return int(m.group(1)) if m else -1


def file_to_model_names(model: nn.Module) -> Callable[[str], KeyTarget]:
    """``rename(file key) -> (the model's tensor name, MergeSlot or None)`` for ``model`` (the
    identity for a model transformers has no conversion mapping for, or no transformers model)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings, rename_source_key
    except ImportError:   # an older transformers: its files carry the model's names
        return lambda key: (key, None)
    if not isinstance(model, PreTrainedModel):
        return lambda key: (key, None)
    transforms = get_model_conversion_mapping(model)
    if not transforms:
        return lambda key: (key, None)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    names = dict.fromkeys(model.state_dict(keep_vars=True))
    prefix = getattr(model, "base_model_prefix", None) or None
    ops = placing_ops()

    def rename(key: str) -> KeyTarget:
        new, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if pattern is None:
            return new, None
        renamed = apply_renamings(key, renamings)
        # the converter transformers applies: the first that matches (core_model_loading.apply_converters)
        converter = next(c for c in converters if c.rename_source_key(renamed)[1] is not None)
        others = [op for op in getattr(converter, "operations", None) or [None] if type(op) not in ops]
        if others or getattr(converter, "quantization_operation", None) is not None:
            raise _refuse(key, new, converter, f"{others[0]!r} computes new values" if others
                          else "a quantization operation")
        index = _index(renamed, pattern)
        if index == -1:
            raise _refuse(key, new, converter, f"its module-list index is not found with {pattern!r}")
        return new, MergeSlot(converter, pattern, index)
    return rename
