"""Fixtures of the training tests that run the trainer in this process."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from hyper_parallel.local import clear_dtensor_caches


@pytest.fixture
def world_of_one(monkeypatch):
    """This process as a plain ``python`` run: no torchrun variables, so ``init_distributed``
    starts a world of one -- without writing them into the environment (a notebook that trains
    keeps its environment); afterwards the group is destroyed, so later tests (fake_world dry
    runs) find the process as it was."""
    assert not dist.is_initialized()
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    for var in names:
        monkeypatch.delenv(var, raising=False)
    yield
    assert not [v for v in names if v in os.environ], "init_distributed wrote the rendezvous into os.environ"
    if dist.is_initialized():
        dist.destroy_process_group()
    clear_dtensor_caches()
