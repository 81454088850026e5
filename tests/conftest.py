"""Shared fixtures: one gloo RankPool per world size for the whole session.

Pools start lazily (a test that needs 4 ranks pays the start once) and stay up until the end:
idle ranks wait on a queue and cost memory (~0.5 GB each, 14 at most), not CPU, while starting a
pool costs 10-30 s on this 2-core machine -- closing one pool whenever a test asked for another
world size restarted pools about fifteen times per run. The fixtures are session-scoped so
module-scoped fixtures can use them too (the pool is the same object either way).
"""
from __future__ import annotations

import pytest

from hyper_parallel.local import RankPool

_POOLS: dict[int, RankPool] = {}


def get_pool(world: int) -> RankPool:
    if world not in _POOLS:
        _POOLS[world] = RankPool(world)
    return _POOLS[world]


@pytest.fixture(scope="session")
def pool2() -> RankPool:
    return get_pool(2)


@pytest.fixture(scope="session")
def pool4() -> RankPool:
    return get_pool(4)


@pytest.fixture(scope="session")
def pool8() -> RankPool:
    return get_pool(8)


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
