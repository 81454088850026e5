"""Shared fixtures: one gloo RankPool per world size for the whole session.

Pools start lazily (a test that needs 4 ranks pays the start once) and are closed at the end.
Only one pool runs at a time: asking for another world size closes the previous one, which keeps
this 2-core machine from running 14 idle torch processes.
"""
from __future__ import annotations

import pytest

from hyper_parallel.local import RankPool

_POOLS: dict[int, RankPool] = {}


def get_pool(world: int) -> RankPool:
    for size in list(_POOLS):
        if size != world:
            _POOLS.pop(size).close()
    if world not in _POOLS:
        _POOLS[world] = RankPool(world)
    return _POOLS[world]


@pytest.fixture
def pool2() -> RankPool:
    return get_pool(2)


@pytest.fixture
def pool4() -> RankPool:
    return get_pool(4)


@pytest.fixture
def pool8() -> RankPool:
    return get_pool(8)


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
