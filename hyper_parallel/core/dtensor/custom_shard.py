"""custom_shard: run a plain-tensor function on the local shards of DTensor inputs.

For code a parallel style cannot express (a fused kernel, a custom attention), the user states
the placements the function expects and produces; torch's ``local_map`` does the unwrapping and
re-wrapping. We add argument checking with errors that say which argument is wrong, and make
input redistribution the default, which is what a plan author almost always wants.
"""
from __future__ import annotations

from typing import Callable, Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement
from torch.distributed.tensor.experimental import local_map

from hyper_parallel.errors import LayoutError, MeshError

PlacementsSpec = Sequence[Placement] | None


def _check_spec(spec, ndim: int, name: str) -> None:
    """A spec is a tuple of placements (one per mesh dim), None, or a sequence of those."""
    if spec is None:
        return
    if isinstance(spec, Placement):
        raise LayoutError(f"custom_shard: {name} must be a tuple of placements per tensor, got {spec!r}")
    items = list(spec)
    if items and all(isinstance(p, Placement) for p in items):
        if len(items) != ndim:
            raise LayoutError(
                f"custom_shard: {name} has {len(items)} placements for a {ndim}-D mesh: {spec!r}"
            )
        return
    for i, sub in enumerate(items):
        _check_spec(sub, ndim, f"{name}[{i}]")


def custom_shard(
    func: Callable,
    device_mesh: DeviceMesh,
    out_placements,
    in_placements=None,
    redistribute_inputs: bool = True,
) -> Callable:
    """Wrap ``func`` so it receives local shards and its outputs become DTensors.

    ``out_placements``: per output, a tuple with one placement per mesh dim (None for a
    non-tensor output). ``in_placements``: the same per input, or None to accept inputs as they
    are. With ``redistribute_inputs`` DTensor inputs in other layouts are redistributed first.
    """
    if not callable(func):
        raise TypeError(f"custom_shard: func must be callable, got {type(func).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise MeshError(f"custom_shard: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    _check_spec(out_placements, device_mesh.ndim, "out_placements")
    _check_spec(in_placements, device_mesh.ndim, "in_placements")
    return local_map(
        func,
        out_placements=out_placements,
        in_placements=in_placements,
        device_mesh=device_mesh,
        redistribute_inputs=redistribute_inputs,
    )
