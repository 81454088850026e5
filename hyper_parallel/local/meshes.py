"""Per-process cache of device meshes, for code running inside a RankPool worker.

Creating a mesh creates process groups (a collective over all ranks); code that reuses the same
mesh shape in one worker (the demo, verify's numerics, tests) should pay that once per pool, not
once per call.
"""
from __future__ import annotations

from functools import lru_cache

from hyper_parallel.platform import device_type


@lru_cache(maxsize=None)
def cached_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """init_device_mesh on this process's device type, created once per (shape, names)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type(), shape, mesh_dim_names=names)
