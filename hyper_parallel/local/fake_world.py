"""Dry runs at any world size on one CPU: torch's fake process group, in a world of its own.

Collectives on the fake group return immediately without moving data, so a plan for 512 ranks
can be applied to a meta-device model and its collectives counted with CommDebugMode. The fake
default group lives in an :func:`~hyper_parallel.local.isolated_world.isolated_world`, so it can
start inside a launched job (after ``init_process_group``, whose groups it leaves untouched and
never talks to) and inside another fake world; blocks nest.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from hyper_parallel.errors import InvalidWorldError
from hyper_parallel.local.isolated_world import isolated_world


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Make the default group a fake group of ``world_size`` ranks (this process is ``rank``) for
    the block; the process's own groups, if any, are back as they were afterwards."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidWorldError(f"fake_world: world_size={world_size!r}: use an int >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidWorldError(f"fake_world: rank={rank!r}: use an int in 0..{world_size - 1}")
    with isolated_world():
        with _no_init_barrier():
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        yield


@contextlib.contextmanager
def _no_init_barrier() -> Iterator[None]:
    """``TORCH_DIST_INIT_BARRIER=1`` (a job's environment may set it) makes ``init_process_group``
    wait on its store for every rank; a fake world has one process, so it would wait forever."""
    old = os.environ.get("TORCH_DIST_INIT_BARRIER")
    os.environ["TORCH_DIST_INIT_BARRIER"] = "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_DIST_INIT_BARRIER", None)
        else:
            os.environ["TORCH_DIST_INIT_BARRIER"] = old
