"""Image inputs for transformers' vision-language families, derived from the model itself.

A VL model checks that its text holds exactly as many image tokens as its vision tower makes
features, so a batch of token ids alone cannot run it, and a batch whose images the forward
never sees plans a tower that never trains. This module builds, for a model without an
``extra_inputs`` hook, the inputs a processor would: the token ids with one image's worth of
image tokens placed at the start of every row, and the pixel tensors in the layout the family's
``get_image_features`` takes. Nothing is listed per family: the image token id, the image size
and the number of tokens an image becomes are read off the config and measured by running the
model's own ``get_image_features`` once on one image (on meta tensors for a model on meta).

Layouts are told apart by what the model takes: ``pixel_values`` alone (LLaVA, PaliGemma,
Gemma 3, InternVL, Aya Vision, Florence-2), with ``image_sizes`` (Mistral 3), with
``pixel_attention_mask`` (Idefics 3, SmolVLM: one tile per image), any-resolution tiles with
``image_sizes`` as ints (LLaVA-NeXT: the tile count from the model's own tiling function), patch
sequences with ``image_grid_thw`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: :mod:`autoplan.capture.patch_grid`).
Families fed through cross-attention (Mllama) or without an image size in their config
(Florence-2) are refused with a :class:`~autoplan.errors.CaptureError` naming what to give
instead: an ``extra_inputs(tokens) -> dict`` hook on the model.

Pixel values are a function of each row's tokens (seeded by the row's content), so a rank that
holds some rows of a batch builds the same images for them as one device does for the whole.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.distributed.tensor import DTensor

from autoplan.capture.fake import valued_mode, values_on
from autoplan.capture.patch_grid import SIZE_INPUTS, PatchGrid, complete_grid_inputs, patch_grid, takes_grid
from autoplan.errors import CaptureError

__all__ = ["HookInputs", "ImageBatch", "SIZE_INPUTS", "derive", "image_inputs", "inputs_with_values",
           "is_vision_language", "param_dtype", "value_checks_off"]


@dataclass(frozen=True)
class ImageBatch:
    """How one image enters a row: ``per_image`` tokens of ``token_id`` at the row's start, and
    pixel tensors of ``pixel_shape`` (one image, no batch dimension)."""

    token_id: int
    per_image: int
    pixel_shape: tuple[int, ...]
    layout: str          # "pixels", "pixels+sizes", "tiles", "anyres" or "patches" (see the module docstring)
    dtype: torch.dtype
    patches: PatchGrid | None = None   # the grid of a "patches" image (autoplan.capture.patch_grid)

    def __call__(self, tokens: torch.Tensor) -> dict:
        """``input_ids`` (``tokens`` with the image tokens placed) and the pixel inputs."""
        rows, seq = tokens.shape[0], tokens.shape[-1]
        if seq <= self.per_image:
            raise CaptureError(f"image inputs: a row of {seq} tokens cannot hold one image of {self.per_image} "
                               f"image tokens and text after it; give sequences longer than {self.per_image}")
        ids = tokens.clone()
        if not (tokens.is_meta or is_fake(tokens)):
            # an image token in the text (synthetic ids) would count as one more image token than
            # the image has features; a processor never puts one there: its neighbour stands in
            ids = torch.where(ids == self.token_id, self.token_id - 1 if self.token_id else 1, ids)
        ids[..., : self.per_image] = self.token_id
        if tokens.is_meta or is_fake(tokens):   # shapes only: a capture, a probe on fake tensors
            pixels = torch.empty((rows, *self.pixel_shape), dtype=self.dtype, device=tokens.device)
        else:
            pixels = torch.stack([_row_image(row, self.pixel_shape, self.dtype) for row in tokens])
        out = {"input_ids": ids}
        if self.patches is not None:   # one sequence of every row's patches, and the grid's inputs
            out["pixel_values"] = pixels.flatten(0, 1)
            out.update(self.patches.inputs(rows, seq, tokens.device, tokens.is_meta or is_fake(tokens)))
        elif self.layout == "tiles":
            out["pixel_values"] = pixels.unsqueeze(1)
            out["pixel_attention_mask"] = torch.ones((rows, 1, *self.pixel_shape[-2:]), dtype=torch.bool,
                                                     device=pixels.device)
        else:
            out["pixel_values"] = pixels
        if self.layout in ("anyres", "pixels+sizes"):
            # sizes as ints: the model slices and tiles by them in Python, which a meta tensor
            # cannot answer and a real one answers the same
            out["image_sizes"] = [list(self.pixel_shape[-2:])] * rows
        return out


class HookInputs:
    """A user's ``extra_inputs(tokens)`` hook, called so that a forward without values runs the
    inputs it gives. On real tokens it is the hook. On meta or fake tokens (capture, the probes)
    the hook runs on real CPU tokens of the same shape instead -- a hook builds its tensors on the
    tokens' device, and a meta image grid or meta image sizes have no values for the tower to size
    its work by -- and its outputs are returned as the derived inputs are: the size inputs
    (:data:`SIZE_INPUTS`) with their values, on the CPU, the rest shapes only on the tokens'
    device; a grid model's inputs are completed with what the model would compute from values
    (``patch_grid.complete_grid_inputs``: the tower's positions and segments, the M-RoPE
    positions by the model's own ``get_rope_index``), and ``image_sizes`` become Python ints, as
    the derived layouts give them."""

    def __init__(self, model: nn.Module, hook: Callable[[torch.Tensor], dict]):
        self.model, self.hook = model, hook

    def __call__(self, tokens: torch.Tensor) -> dict:
        if not (tokens.is_meta or is_fake(tokens)):
            return self.hook(tokens)
        with unset_fake_temporarily(), torch.device("cpu"):
            given = dict(self.hook(torch.zeros(tokens.shape, dtype=tokens.dtype)))
            token_id = _first_int(self.model.config, ("image_token_id", "image_token_index"))
            if takes_grid(self.model) and isinstance(given.get("image_grid_thw"), torch.Tensor) \
                    and token_id is not None and given["image_grid_thw"].device.type != "meta":
                given = complete_grid_inputs(self.model, given, token_id, torch.device("cpu"))
            if isinstance(given.get("image_sizes"), torch.Tensor):
                # as plain ints, as derived: the model slices and tiles by them in Python
                given["image_sizes"] = given["image_sizes"].tolist()
        out = {}
        for k, v in given.items():
            if isinstance(v, torch.Tensor) and not (k in SIZE_INPUTS and v.device.type == "cpu"):
                v = torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=tokens.device)
            out[k] = v
        return out


def inputs_with_values(model: nn.Module, kwargs: dict) -> dict | None:
    """``kwargs`` (a capture's inputs, shapes only) with values on the CPU: the image inputs
    :func:`image_inputs` makes for real tokens (zeros) of the shape of ``input_ids``, every other
    tensor without values as zeros. For a tower that filters images by their content, or a decoder
    that indexes by a mask of image tokens: run with these, such sizes are measured, not unknown.
    None for a model without image inputs (or one they cannot be derived for: the reason is the
    earlier attempts'), or when what they make does not match ``kwargs`` (example inputs of other
    shapes)."""
    try:
        make, ids = image_inputs(model), kwargs.get("input_ids")
    except CaptureError:
        return None
    if make is None or not isinstance(ids, torch.Tensor):
        return None
    with unset_fake_temporarily(), torch.device("cpu"):
        given = make(torch.zeros(tuple(ids.shape), dtype=ids.dtype))
        out = {}
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor) and (v.is_meta or is_fake(v)):
                real = given.get(k)
                if real is None:
                    real = torch.zeros(tuple(v.shape), dtype=v.dtype)
                if not isinstance(real, torch.Tensor) or tuple(real.shape) != tuple(v.shape):
                    return None
                v = real.to("cpu", v.dtype)
            out[k] = v
    return out


def _row_image(row: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    weights = torch.arange(1, row.numel() + 1, dtype=torch.int64)
    seed = int((row.reshape(-1).to(torch.int64).cpu() * weights).sum()) % (2 ** 31)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).to(row.device)


# model -> (its floating dtype, the measurement): a model cast after a first step measures again
_DERIVED: "weakref.WeakKeyDictionary[nn.Module, tuple[torch.dtype, ImageBatch | None]]" = weakref.WeakKeyDictionary()
_BY_CONFIG: dict[tuple, ImageBatch] = {}


def image_inputs(model: nn.Module) -> Callable[[torch.Tensor], dict] | None:
    """The step's extra inputs for ``model``'s token ids: its ``extra_inputs`` hook, else (a
    transformers VL family) the derived :class:`ImageBatch`, else None (a text model)."""
    hook = getattr(model, "extra_inputs", None)
    if callable(hook):
        return hook if isinstance(hook, ImageBatch) else HookInputs(model, hook)
    dtype = param_dtype(model)
    known = _DERIVED.get(model)
    if known is None or known[0] != dtype:
        batch = None
        if is_vision_language(model):
            # copies of one model (the probe's styled copies, every rank's) share the measurement:
            # it depends only on the class, the config and the dtype, and a styled copy's tower
            # may not run outside its step
            key = (plain_class(model), model.config.to_json_string(use_diff=False), dtype)
            if key not in _BY_CONFIG:
                _BY_CONFIG[key] = derive(model)
            batch = _BY_CONFIG[key]
        known = _DERIVED[model] = (dtype, batch)
    return known[1]


@contextlib.contextmanager
def value_checks_off(model: nn.Module, tokens: torch.Tensor | None = None, every_family: bool = False):
    """transformers' checks of input values off while a ``model`` with image grids (Qwen-VL) runs
    without values (on meta, or ``tokens`` meta or fake): "as many image tokens as image
    features" counts token ids a meta tensor does not hold, and answering it from no data fails
    a model whose derived inputs are consistent by construction. A real run keeps every check.
    ``every_family``: for any VL model (verify's dry run on fake tensors, which counts
    collectives; the probe keeps them for the others, see the module docstring)."""
    shapes_only = tokens is None or tokens.is_meta or is_fake(tokens)
    wanted = takes_grid(model) or (every_family and is_vision_language(model))
    if not (shapes_only and wanted):   # only where the inputs are built so (patch_grid.py)
        yield
        return
    key, before = "TRANSFORMERS_DISABLE_TORCH_CHECK", os.environ.get("TRANSFORMERS_DISABLE_TORCH_CHECK")
    os.environ[key] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def plain_class(model: nn.Module) -> type:
    """``model``'s own class under the wrappers FSDP2 and the runners add (``FSDPLlava...``)."""
    return next((c for c in type(model).__mro__ if not c.__module__.startswith(("torch.", "hyper_parallel."))),
                type(model))


def param_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first floating parameter (float32 if none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def is_vision_language(model: nn.Module) -> bool:
    """A transformers model with a vision tower (its config has a ``vision_config``)."""
    return getattr(getattr(model, "config", None), "vision_config", None) is not None


def derive(model: nn.Module) -> ImageBatch | None:
    """Measure how an image enters ``model`` (see the module docstring); None for a text model."""
    if not is_vision_language(model):
        return None
    config, name = model.config, type(model).__name__
    token_id = _first_int(config, ("image_token_id", "image_token_index"))
    if token_id is None:
        raise CaptureError(f"{name}: its config names no image token (image_token_id / image_token_index), so "
                           f"image inputs cannot be placed in the text; give the model an extra_inputs(tokens) hook")
    if not callable(getattr(model, "get_image_features", None)):
        raise CaptureError(f"{name}: no get_image_features: its images do not enter as image tokens in the text "
                           f"(cross-attention, as Mllama's), which autoplan does not build yet; give the model an "
                           f"extra_inputs(tokens) hook")
    takes = inspect.signature(model.get_image_features).parameters
    forward_takes = inspect.signature(model.forward).parameters
    dtype = param_dtype(model)
    if takes_grid(model):
        grid, shape = patch_grid(model, int(token_id))
        return ImageBatch(int(token_id), grid.tokens, shape, "patches", dtype, grid)
    unknown = [k for k in ("aspect_ratio_ids",) if k in takes or k in forward_takes]
    if "image_sizes" in takes and takes["image_sizes"].default is inspect.Parameter.empty:
        layout = "pixels+sizes"
    elif "pixel_attention_mask" in takes:
        layout = "tiles"
    else:
        layout = "pixels"
    tiles = _tiles(model) if _tiled(model) else None
    if unknown or (_tiled(model) and tiles is None):
        raise CaptureError(f"{name}: its images are not one pixel tensor per image (it takes {unknown or 'tiles'}), "
                           f"which autoplan does not build yet; give the model an extra_inputs(tokens) hook "
                           f"returning input_ids with the image tokens placed and the pixel inputs")
    vision = config.vision_config
    size = getattr(vision, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    if not isinstance(size, int) or size <= 0:
        raise CaptureError(f"{name}: vision_config has no image_size to build an image of; give the model an "
                           f"extra_inputs(tokens) hook")
    channels = int(_first_int(vision, ("num_channels", "in_channels")) or 3)
    if tiles is not None:   # an image of the tower's size, cut as the model's own tiling cuts it
        layout, shape = "anyres", (tiles([size, size]), channels, size, size)
    else:
        shape = (channels, size, size)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    one_image = ImageBatch(int(token_id), 0, shape, layout, dtype)
    measured = model
    if plain_class(model) is not type(model) or any(isinstance(p, DTensor) for p in model.parameters()):
        # a sharded or wrapped model (FSDP2, the runners' styles) runs its tower only inside its
        # step: the measurement is the plain class's from the config, on meta
        with torch.device("meta"):
            measured = plain_class(model)(model.config).to(dtype)
        device = torch.device("meta")
    try:
        features = _one_image_features(measured, one_image, device)
    except Exception as exc:  # noqa: BLE001 - a tower that cannot run one image is refused, typed
        raise CaptureError(f"{name}.get_image_features failed on one {size}x{size} image: "
                           f"{type(exc).__name__}: {exc}") from exc
    hidden = _first_int(config.get_text_config(), ("hidden_size", "d_model"))
    count = _feature_rows(features, hidden)
    if isinstance(count, torch.SymInt):   # sized by the image's values: their count, when propagated
        count = _known_int(count)
    if count is not None and not isinstance(count, int):
        raise CaptureError(f"{name}: the number of image features depends on the pixel values ({count}: the tower "
                           f"filters images by their content), which a model on meta cannot measure; give the model "
                           f"an extra_inputs(tokens) hook")
    if count is None:
        raise CaptureError(f"{name}.get_image_features returned no features of the text width {hidden}; give the "
                           f"model an extra_inputs(tokens) hook")
    return ImageBatch(int(token_id), count, shape, layout, dtype)


def _one_image_features(model: nn.Module, one_image: ImageBatch, device: torch.device):
    """``model.get_image_features`` of one image. A model on meta runs a copy on fake tensors
    with a shape environment: a tower that reads its image sizes (Pixtral) gets them as
    constants, and checks on data become deferred assertions."""
    if device.type != "meta":
        with torch.no_grad():
            kwargs = one_image(torch.ones((1, 1), dtype=torch.long, device=device))
            kwargs.pop("input_ids")
            return model.get_image_features(**kwargs)
    stand_in = copy.deepcopy(model)
    with torch.device("cpu"):   # one real image: a tower that filters images by content reads it
        kwargs = one_image(torch.ones((1, 1), dtype=torch.long))
    kwargs.pop("input_ids")
    # on the CPU whatever device context the caller is in: fake tensors of one device, the
    # image's values propagated where an op reads only them (the weights are made without values)
    mode = valued_mode()
    with torch.device("cpu"), mode, torch.no_grad():
        stand_in.to_empty(device="cpu")
        with values_on(mode):
            return stand_in.get_image_features(**kwargs)


def _known_int(value: torch.SymInt) -> int | torch.SymInt:
    """``value`` as an int when its symbols have values (from propagated real tensors), else as is."""
    shape_env = value.node.shape_env
    known = value.node.expr.xreplace(shape_env.real_tensor_prop_unbacked_vals)
    return int(known) if known.is_number else value


def _tiles(model: nn.Module) -> Callable[[list[int]], int] | None:
    """The number of tiles (with the base image) an image of a given size becomes, by the
    model's own function (LLaVA-NeXT's ``image_size_to_num_patches`` in its module), or None."""
    # through the class's bases: FSDP2 and the runners wrap a model in classes of their own
    fn = next((f for c in type(model).__mro__
               if (f := getattr(sys.modules.get(c.__module__), "image_size_to_num_patches", None)) is not None), None)
    if fn is None:
        return None
    config = model.config
    return lambda image: int(fn(image_size=image, grid_pinpoints=config.image_grid_pinpoints,
                                patch_size=config.vision_config.image_size))


def _tiled(model: nn.Module) -> bool:
    """LLaVA-NeXT-style any-resolution tiling: image_grid_pinpoints in the config."""
    return getattr(model.config, "image_grid_pinpoints", None) is not None


def _first_int(obj, names) -> int | None:
    for n in names:
        v = getattr(obj, n, None)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _feature_rows(features, hidden: int | None) -> int | None:
    """Image tokens one image became: the projected features' element count over the text width
    (``pooler_output`` of transformers' output, or a tensor / list of tensors)."""
    out = getattr(features, "pooler_output", features)
    tensors = [out] if isinstance(out, torch.Tensor) else [t for t in (out or ()) if isinstance(t, torch.Tensor)]
    if not tensors or not hidden or any(t.shape[-1] != hidden for t in tensors):
        return None
    return sum(t.numel() for t in tensors) // hidden
