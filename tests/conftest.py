"""Shared fixtures: one gloo RankPool per world size for the whole session.

Pools start lazily (a test that needs 4 ranks pays the start once) and stay up until the end:
idle ranks wait on a queue and cost memory (~0.5 GB each, 14 at most), not CPU, while starting a
pool costs 10-30 s on this 2-core machine -- closing one pool whenever a test asked for another
world size restarted pools about fifteen times per run. The fixtures are session-scoped so
module-scoped fixtures can use them too (the pool is the same object either way).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from hyper_parallel.local import RankPool

_POOLS: dict[int, RankPool] = {}


def _pin_cpu_profile() -> None:
    """Every test process (and the ranks and launches it starts, which inherit the environment)
    reads the ``cpu`` hardware profile from a cache of this session's own, holding a profile
    measured once on this machine kind (tests/data/cpu_profile.json; links: gloo loopback, 1 ms a
    message). The measured profile depends on the machine's load at the moment it is measured
    and on which earlier runs calibrated the user's cache, and planner tests that price on it
    (the cp variant at 64 tokens, an MPipe tower's placement) flipped with it. Tests that measure
    or calibrate use caches of their own."""
    from cost_models.hardware.host import cache_dir, host_key

    if os.environ.get("AUTOPLAN_TESTS_CACHE_PINNED"):
        return
    root = Path(tempfile.mkdtemp(prefix="autoplan-test-cache-"))
    os.environ["AUTOPLAN_CACHE_DIR"] = str(root)
    os.environ["AUTOPLAN_TESTS_CACHE_PINNED"] = str(os.getpid())   # the process that removes it at the end
    (cache_dir() / "hardware").mkdir(parents=True, exist_ok=True)
    stem = host_key().rsplit("-t", 1)[0]
    for threads in range(1, max(16, os.cpu_count() or 1) + 1):   # host_key names the thread count
        shutil.copy(Path(__file__).parent / "data/cpu_profile.json", cache_dir() / "hardware" / f"cpu-{stem}-t{threads}.json")


_pin_cpu_profile()


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
    if os.environ.get("AUTOPLAN_TESTS_CACHE_PINNED") == str(os.getpid()):
        shutil.rmtree(os.environ["AUTOPLAN_CACHE_DIR"], ignore_errors=True)
