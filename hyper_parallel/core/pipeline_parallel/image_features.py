"""A transformers vision-language model's tower as one module, for MPipe: image inputs in, the
features its forward merges out.

transformers' VL models take their tower's output precomputed: ``forward(...,
mm_encoder_outputs={"image": get_image_features(..., return_dict=True)})`` skips the tower and
merges the given features at the image tokens (and, for Qwen3-VL, adds its DeepStack levels in
the decoder). That is the seam MPipe needs, and it is the model's own: :class:`ImageFeatures`
runs ``get_image_features`` on an owner rank, and stage 0's forward receives what it returned
(forward_split.ForwardStage passes it as ``mm_encoder_outputs``). Nothing is re-implemented:
the merge, the placeholder checks, M-RoPE positions and masks stay the model's code.

What crosses the pipeline is tensors: the features a forward merges (``pooler_output``, the
image features, and any ``*_features`` field such as DeepStack's levels) -- one tensor per field,
a per-image list concatenated on its first dimension (Qwen-VL splits its features by image),
levels of per-image lists (Qwen3-VL's ``deepstack_features``) one tensor a level -- preceded by a
``uint8`` header of fixed size (:data:`HEADER_BYTES`) holding their layout (field names, and a
list's row counts, as JSON: carried.encode_header), so the receiving rank rebuilds the same
structure without having run the tower. Fixed and concatenated so that what crosses is known without running
the tower (a planner on fake tensors cannot run Qwen-VL's, whose attention splits by values): the
header, then one tensor per field. Diagnostic fields (every layer's hidden states) stay on the owner.
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn as nn

from hyper_parallel.core.pipeline_parallel.carried import decode_header, encode_header, holds_values
from hyper_parallel.core.pipeline_parallel.forward_split import IMAGE_FEATURES, TOWER_INPUT_PREFIX, attach, trace_forward
from hyper_parallel.errors import PipelineError

INTO = IMAGE_FEATURES   # the step keyword stage 0 receives the tower output under
METHOD = "get_image_features"
HEADER_BYTES = 1024     # the layout header's size on the wire, whatever the layout (row counts of ~250 images)


def runnable_placements(module: str) -> tuple[str, ...]:
    """The placements of a VL tower the runtime runs, for a plan's ``pipeline.preprocess.module``:
    MPipe always; stage 0 for ``get_image_features`` (the stages run the model's own forward, the
    tower is stage 0's: forward_split.ForwardTrace.side). A tower as stages of its own
    ("own_stage") would hand the decoder a second value across the pipeline: priced, not run."""
    return ("mpipe", "stage0") if module == METHOD else ("mpipe",)


def _merged_fields(out) -> list[str]:
    keys = list(out.keys()) if hasattr(out, "keys") else []
    return [k for k in keys if k == "pooler_output" or k.endswith("_features")]


class ImageFeatures(nn.Module):
    """``model.get_image_features`` as a module whose parameters are the tower's (the modules the
    token-only forward never calls, forward_split.ForwardTrace.side), registered under their FQNs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        name = type(model).__name__
        if not callable(getattr(model, METHOD, None)):
            raise PipelineError(f"ImageFeatures: {name} has no {METHOD}(); its tower cannot run apart from the "
                                "decoder (give the pipeline a Preprocess of your own tower module)")
        inner = getattr(model, "model", model)
        if "mm_encoder_outputs" not in inspect.signature(inner.forward).parameters:
            raise PipelineError(f"ImageFeatures: {type(inner).__name__}.forward takes no mm_encoder_outputs, so "
                                "stage 0 could not be handed the tower's output; place the tower on stage 0")
        trace = trace_forward(model)
        side = trace.side
        if not side:
            raise PipelineError(f"ImageFeatures: {name}'s forward calls every module on token ids alone; no "
                                "tower to run apart")
        object.__setattr__(self, "_model", model)
        for fqn in side:
            attach(self, fqn, model.get_submodule(fqn))
        for fqn in trace.side_params:   # a container's own parameter beside the tower (image_newline)
            attach(self, fqn, model.get_parameter(fqn))

    def forward(self, **inputs) -> tuple[torch.Tensor, ...]:
        out = getattr(self._model, METHOD)(**inputs, return_dict=True)
        layout, tensors = {}, []
        for key in _merged_fields(out):
            value = out[key]
            if isinstance(value, torch.Tensor):
                layout[key] = -1
                tensors.append(value)
            elif isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
                rows = _rows(value)
                if rows is not None:   # one tensor, split back by each piece's rows
                    layout[key] = rows
                    tensors.append(torch.cat(list(value), dim=0))
                else:
                    layout[key] = len(value)
                    tensors.extend(value)
            elif isinstance(value, (list, tuple)) and value and all(
                    isinstance(v, (list, tuple)) and _rows(v) is not None and _rows(v) == _rows(value[0])
                    for v in value):
                # levels of per-image lists (Qwen3-VL's DeepStack features): one tensor a level
                layout[key] = {"levels": len(value), "rows": _rows(value[0])}
                tensors.extend(torch.cat(list(v), dim=0) for v in value)
        if not tensors:
            raise PipelineError(f"ImageFeatures: {type(self._model).__name__}.{METHOD} returned no pooler_output "
                                f"or *_features tensors ({type(out).__name__})")
        object.__setattr__(self, "layout", layout)   # the last call's, for a caller holding no values (a dry run)
        return (encode_header(layout, HEADER_BYTES, tensors[0].device, "ImageFeatures"), *tensors)

    def unpack(self, tensors: Sequence[torch.Tensor], layout: dict | None = None) -> SimpleNamespace:
        """The tower output stage 0 hands the forward (attribute access, as a ModelOutput), its layout
        read from the header. A header that holds no values (a dry run on fake or meta tensors) is
        read as this tower's last call laid its output out (every micro-batch's is the same)."""
        header = tensors[0]
        if layout is None and not holds_values(header):
            layout = getattr(self, "layout", None)
            if layout is None:
                raise PipelineError("ImageFeatures.unpack: the header holds no values (fake or meta tensors) and "
                                    "this tower has not run yet to say how its output is laid out")
        if layout is None:
            layout = decode_header(header)
        fields, i = {}, 1
        for key, n in layout.items():
            if isinstance(n, dict):   # levels of per-image lists, one tensor a level
                levels = tensors[i:i + n["levels"]]
                fields[key], i = [tuple(torch.split(t, n["rows"], dim=0)) for t in levels], i + n["levels"]
            elif isinstance(n, list):   # a per-image list sent as one tensor
                fields[key], i = tuple(torch.split(tensors[i], n, dim=0)), i + 1
            elif n < 0:
                fields[key], i = tensors[i], i + 1
            else:
                fields[key], i = tuple(tensors[i:i + n]), i + n
        return SimpleNamespace(**fields)


def _rows(value: Sequence) -> list[int] | None:
    """Each piece's rows, when a per-image list of tensors can cross as one (same trailing shape
    and dtype); None otherwise."""
    if value and all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[1:] == value[0].shape[1:]
                     and v.dtype == value[0].dtype for v in value):
        return [int(v.shape[0]) for v in value]
    return None


def tower_inputs(model: nn.Module, step_keys: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the step keywords only the tower reads -- its image tensors and precomputed image inputs,
    ``pixel_*`` / ``image_*`` --, those it reads that the decoder's forward takes too -- e.g.
    Qwen-VL's ``image_grid_thw`` for M-RoPE positions, LLaVA-NeXT's ``image_sizes``)."""
    takes = set(inspect.signature(getattr(model, METHOD)).parameters)
    forward = set(inspect.signature(model.forward).parameters)
    tower = [k for k in step_keys if k.startswith((TOWER_INPUT_PREFIX, "image_")) or k in takes]
    both = [k for k in tower if k in forward and not k.startswith(TOWER_INPUT_PREFIX)]
    return [k for k in tower if k not in both], both
