"""The fixed registry of style names: the only styles a plan file can name.

It spans the style packages (tensor, expert and context parallel), so it lives above them: a
package below that imported it would import the others' styles, which are built on
``tensor_parallel.base`` -- a cycle that worked only in one import order.

``style_from_dict`` is how a plan is turned back into objects; it looks names up here and never
imports or evaluates anything named in the data.
"""
from __future__ import annotations

from typing import Any

from hyper_parallel.core.expert_parallel.dense import DenseExpertsParallel
from hyper_parallel.core.expert_parallel.flat import FlatExpertsParallel
from hyper_parallel.core.expert_parallel.paired import PairedExpertsParallel
from hyper_parallel.core.expert_parallel.style import ExpertParallel
from hyper_parallel.core.context_parallel.style import ContextParallel
from hyper_parallel.core.tensor_parallel.base import ParallelStyle
from hyper_parallel.core.tensor_parallel.latent_styles import PrepareLatentInput
from hyper_parallel.core.tensor_parallel.mamba_styles import MambaMixerParallel
from hyper_parallel.core.tensor_parallel.head_styles import PrepareHeadsInput
from hyper_parallel.core.tensor_parallel.kv_styles import KVReplicatedParallel
from hyper_parallel.core.tensor_parallel.linear_styles import ColwiseParallel, RowwiseParallel
from hyper_parallel.core.tensor_parallel.prepare_styles import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
from hyper_parallel.core.tensor_parallel.replicate_styles import NoParallel, SequenceParallel
from hyper_parallel.core.tensor_parallel.sequence_region import GatheredRegion
from hyper_parallel.core.tensor_parallel.uneven_heads import HeadColsParallel, HeadRowsParallel
from hyper_parallel.errors import StyleSpecError

STYLES: dict[str, type[ParallelStyle]] = {
    cls.__name__: cls
    for cls in (ColwiseParallel, RowwiseParallel, SequenceParallel, NoParallel,
                PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput, PrepareHeadsInput,
                ExpertParallel, ContextParallel, PrepareLatentInput, KVReplicatedParallel,
                DenseExpertsParallel, FlatExpertsParallel, PairedExpertsParallel, MambaMixerParallel,
                GatheredRegion, HeadRowsParallel, HeadColsParallel)
}


def style_from_dict(data: dict[str, Any]) -> ParallelStyle:
    """Rebuild a style from ``{"style": name, "args": {...}}`` (the output of ``to_dict``)."""
    if not isinstance(data, dict) or "style" not in data:
        raise StyleSpecError(f"a style must be a dict with a 'style' key, got {data!r}")
    name = data["style"]
    if name not in STYLES:
        raise StyleSpecError(f"unknown style {name!r}; known styles: {sorted(STYLES)}")
    args = data.get("args", {})
    if not isinstance(args, dict):
        raise StyleSpecError(f"{name}: 'args' must be a dict, got {args!r}")
    extra = set(data) - {"style", "args"}
    if extra:
        raise StyleSpecError(f"{name}: unexpected keys {sorted(extra)} beside 'style' and 'args'")
    return STYLES[name].from_args_data(args)


def plan_to_dict(plan: dict[str, ParallelStyle]) -> dict[str, dict[str, Any]]:
    """A flat {pattern: style} plan as data."""
    return {pattern: style.to_dict() for pattern, style in plan.items()}


def plan_from_dict(data: dict[str, dict[str, Any]]) -> dict[str, ParallelStyle]:
    return {pattern: style_from_dict(spec) for pattern, spec in data.items()}
