"""Images as patch sequences with a (t, h, w) grid -- Qwen2-VL, Qwen2.5-VL, Qwen3-VL.

These towers take no image tensor: they take every image's patches flattened to one
``(patches, channels * temporal_patch_size * patch_size**2)`` tensor plus ``image_grid_thw``, and
read the grid's *values* to size their work (rotary positions, the packed attention segments,
windows, the position-embedding interpolation, the split of the features per image). On meta
those values do not exist, so the inputs are built as transformers documents for export
(``transformers.vision_utils``: "pre-computing very dynamic and data-dependent tensors"): the
tower's rotary positions, window order and interpolation taps are computed here from the grid
and passed as ``image_*`` keywords, and the inputs whose values are sizes (the grid, the packed
segment bounds: :data:`SIZE_INPUTS`) stay real CPU tensors even for a model on meta, so the
splits the tower makes by them get real sizes.

The decoder's M-RoPE positions are computed by the model's own ``get_rope_index`` on one
concrete row (image tokens first, text after), once, and passed as ``position_ids``: capture, the
soundness probe and every runner then see the same positions without the model reading token
values, and a row's positions do not depend on the other rows.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
import torch._functorch.config as functorch_config
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from transformers.vision_utils import (get_vision_cu_seqlens, get_vision_interpolation_indices_and_weights,
                                       get_vision_position_ids, get_vision_window_index)

from autoplan.errors import CaptureError

# inputs whose values are sizes the forward computes shapes from: real tensors even for a model
# on meta (kept off meta by capture's inputs), so its data-dependent shapes resolve from them
SIZE_INPUTS = ("image_grid_thw", "image_cu_seqlens", "image_cu_window_seqlens")


@dataclass(frozen=True)
class PatchGrid:
    """One image as ``grid`` = (t, h, w) patches merged ``merge`` x ``merge`` into tokens; the
    tower's extras (``window``: (window_size, patch_size) of a windowed tower; ``interp``:
    (num_grid_per_side, mode, align_corners) of an interpolated position embedding) and the M-RoPE
    positions of the image's tokens (3 rows) with the first text position after them."""

    grid: tuple[int, int, int]
    merge: int
    window: tuple[int, int] | None
    interp: tuple[int, str, bool] | None
    positions: tuple[tuple[int, ...], ...]
    text_start: int

    @property
    def tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // self.merge ** 2

    def inputs(self, rows: int, seq: int, device: torch.device, shapes_only: bool) -> dict:
        """Everything but the pixels for ``rows`` rows of ``seq`` tokens, one image each."""
        with torch.device("cpu"):   # computed from the grid's values, whatever the caller's device context
            grid = torch.tensor([list(self.grid)] * rows, dtype=torch.long)
            image = torch.tensor(self.positions, dtype=torch.long)
            text = torch.arange(self.text_start, self.text_start + seq - self.tokens).expand(3, -1)
            out = tower_inputs(grid, self.merge, self.window, self.interp, device, shapes_only)
            out["position_ids"] = torch.cat([image, text], dim=1)[:, None, :].expand(3, rows, seq).contiguous() \
                .to(device)
            return out


def tower_inputs(grid: torch.Tensor, merge: int, window: tuple[int, int] | None, interp: tuple[int, str, bool] | None,
                 device: torch.device, shapes_only: bool) -> dict:
    """What the tower computes from the values of ``grid`` (one (t, h, w) row per image), computed
    here by transformers' export recipe: the grid, the rotary positions, the packed segment bounds,
    the window order and the interpolation taps. The size inputs stay on the CPU when
    ``shapes_only`` (a model on meta reads their values); the rest go to ``device``."""
    sizes_device = torch.device("cpu") if shapes_only else device
    grid = grid.to("cpu", torch.long)
    out = {
        "image_grid_thw": grid.to(sizes_device),
        "image_position_ids": get_vision_position_ids(grid, merge).to(device),
        "image_cu_seqlens": get_vision_cu_seqlens(grid).to(sizes_device),
    }
    if window is not None:
        index, bounds = get_vision_window_index(grid, merge, window[0], window[1])
        out["image_window_index"] = index.to(device)
        out["image_cu_window_seqlens"] = bounds.to(sizes_device)
    if interp is not None:
        side, mode, corners = interp
        idx, weights = get_vision_interpolation_indices_and_weights(
            grid, side, mode=mode, align_corners=corners, spatial_merge_size=merge)
        out["image_interp_indices"], out["image_interp_weights"] = idx.to(device), weights.to(device)
    return out


def complete_grid_inputs(model: nn.Module, given: dict, token_id: int, device: torch.device) -> dict:
    """A user's image inputs for a grid model (a processor's ``input_ids``, ``pixel_values`` and
    ``image_grid_thw``, with values: on the CPU) completed for a forward without values: the tower's
    inputs from the grid (:func:`tower_inputs`) and the decoder's M-RoPE ``position_ids`` by the
    model's own ``get_rope_index`` on the given ids -- what the model would compute from values a
    meta tensor does not hold. What ``given`` already holds is kept; tensors not read as sizes go to
    ``device``."""
    tower, rope, merge, window, interp = _tower(model)
    grid, ids = given["image_grid_thw"], given.get("input_ids")
    out = tower_inputs(grid, merge, window, interp, device, shapes_only=True)
    if ids is not None and "position_ids" not in given:
        with torch.device("cpu"):
            ids = ids.to("cpu")
            out["position_ids"] = rope(ids, (ids == token_id).int(), image_grid_thw=grid.to("cpu", torch.long))[0] \
                .to(device)
    return {**out, **{k: v for k, v in given.items() if k != "image_grid_thw"}}


def has_real_sizes(kwargs: dict) -> bool:
    """Whether ``kwargs`` hold size inputs with values (a grid model's capture inputs)."""
    return any(isinstance(kwargs.get(k), torch.Tensor) and not kwargs[k].is_meta for k in SIZE_INPUTS)


def sizes_from_values(kwargs: dict):
    """Export with fake tensors that keep the real values of the size inputs in ``kwargs`` (torch's
    real-tensor propagation), so ``.tolist()`` of a grid gives the sizes it holds instead of
    unknowns every later shape would have to guard on; nothing when there are none."""
    if not has_real_sizes(kwargs):
        return contextlib.nullcontext()
    return functorch_config.patch(fake_tensor_propagate_real_tensors=True)


def takes_grid(model: nn.Module) -> bool:
    """Whether ``model``'s images come with ``image_grid_thw`` (the Qwen-VL convention)."""
    return (getattr(getattr(model, "config", None), "vision_config", None) is not None
            and "image_grid_thw" in inspect.signature(model.forward).parameters)


def patch_grid(model: nn.Module, token_id: int) -> tuple[PatchGrid, tuple[int, int]]:
    """The :class:`PatchGrid` of one image for ``model`` and the shape of its patches
    (patches, patch width). The image is ``vision_config.image_size`` pixels square (224 when
    the config names none, the processors' usual size), in whole merge blocks."""
    vision = model.config.vision_config
    tower, rope, merge, window, interp = _tower(model)
    patch = _int(vision, "patch_size")
    temporal, channels = _int(vision, "temporal_patch_size"), _int(vision, "in_channels", 3)
    size = _int(vision, "image_size", 224)
    side = max(merge, size // patch // merge * merge)
    grid = (1, side, side)
    per_image = side * side // merge ** 2
    # the model's own M-RoPE of one row, from its config alone: on real CPU tensors even when first
    # asked inside a fake mode (verify's dry run of a plan loaded from JSON), where it reads its values
    with unset_fake_temporarily(), torch.device("cpu"):
        ids = torch.full((1, per_image + 1), token_id, dtype=torch.long)
        ids[0, -1] = 0
        positions, _ = rope(ids, (ids == token_id).int(), image_grid_thw=torch.tensor([list(grid)]))
    positions = positions[:, 0, :]
    layout = PatchGrid(grid, merge, window, interp, tuple(tuple(int(v) for v in r) for r in positions[:, :per_image]),
                       int(positions[0, -1]))
    return layout, (side * side, channels * temporal * patch * patch)


def _tower(model: nn.Module):
    """(tower, get_rope_index, merge, window, interp) of a grid model: the module taking
    ``grid_thw`` with a ``spatial_merge_size``, the model's own M-RoPE, and the tower's extras
    (``window``: (window_size, patch_size); ``interp``: (num_grid_per_side, mode, align_corners))."""
    name, vision = type(model).__name__, model.config.vision_config
    tower = next((m for m in model.modules() if m is not model and hasattr(m, "spatial_merge_size")
                  and "grid_thw" in inspect.signature(m.forward).parameters), None)
    rope = next((m.get_rope_index for m in model.modules() if callable(getattr(m, "get_rope_index", None))), None)
    if tower is None or rope is None:
        raise CaptureError(f"{name}: takes image_grid_thw but has no tower taking grid_thw with a spatial_merge_size "
                           f"or no get_rope_index; give the model an extra_inputs(tokens) hook")
    window = (int(tower.window_size), _int(vision, "patch_size")) if hasattr(tower, "window_size") else None
    interp = ((int(tower.num_grid_per_side), str(tower.interpolation_mode), bool(tower.interpolation_align_corners))
              if hasattr(tower, "num_grid_per_side") else None)
    return tower, rope, int(tower.spatial_merge_size), window, interp


def _int(config, name: str, default: int | None = None) -> int:
    v = getattr(config, name, default)
    v = v[0] if isinstance(v, (list, tuple)) else v
    if not isinstance(v, int):
        raise CaptureError(f"{type(config).__name__}.{name} is {v!r}, not a size; give the model an "
                           f"extra_inputs(tokens) hook")
    return v
