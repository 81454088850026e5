"""Dry runs at any world size on one CPU: torch's fake process group.

Collectives on the fake group return immediately without moving data, so a plan for 512 ranks
can be applied to a meta-device model and its collectives counted with CommDebugMode.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.distributed as dist

from hyper_parallel.errors import DistributedRunError


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Initialise the default group as a fake group of ``world_size`` ranks for the block."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise DistributedRunError(
            "fake_world: a default process group already exists in this process; "
            "dry runs need a process of their own"
        )
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions keyed by specs whose meshes compare equal across worlds;
    a mesh of a previous (destroyed) world could then lend its process-group names to this one."""
    from torch.distributed.tensor import DTensor

    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    cached_meta = getattr(prop, "_propagate_tensor_meta_cached", None)
    if cached_meta is not None and hasattr(cached_meta, "cache_clear"):
        cached_meta.cache_clear()
    import torch

    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ fast path keeps its own copy
        native()
