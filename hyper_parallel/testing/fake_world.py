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
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
