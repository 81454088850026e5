"""The shared multi-rank harness: results per rank, typed failures, recovery after a failure."""
import pytest
import torch
import torch.distributed as dist

from hyper_parallel.errors import DistributedRunError
from hyper_parallel.local import fake_world


def _rank_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return (dist.get_rank(), t.item())


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    return dist.get_rank()


def test_pool_runs_collectives_and_returns_per_rank(pool2):
    assert pool2.run(_rank_sum) == [(0, 1.0), (1, 1.0)]


def test_failure_is_reported_with_rank_and_pool_recovers(pool2):
    with pytest.raises(DistributedRunError, match="boom on rank one"):
        pool2.run(_fail_on_rank_one)
    assert pool2.run(_rank_sum) == [(0, 1.0), (1, 1.0)]


def test_fake_world_counts_world_size_and_nests_in_a_world_of_its_own():
    with fake_world(64):
        assert dist.get_world_size() == 64
        with fake_world(8, rank=3):
            assert (dist.get_world_size(), dist.get_rank()) == (8, 3)
        assert (dist.get_world_size(), dist.get_rank()) == (64, 0)
    assert not dist.is_initialized()
