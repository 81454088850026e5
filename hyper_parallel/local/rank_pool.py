"""A pool of CPU/gloo ranks that starts its process group once and runs many checks in it.

Starting a process group costs seconds on this machine kind, so everything that runs the runtime
on local ranks -- the demo, verify's numerics check, cost-model calibration, benchmarks, tests --
keeps one pool per world size and sends it many functions. Functions sent to the pool must be
importable (module level). A failure on any rank is
raised in the parent with every failing rank's traceback; a rank that does not answer within
the timeout gets the whole pool torn down, so a bug fails a test instead of hanging the suite.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from hyper_parallel.errors import DistributedRunError

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks, results, pg_timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
    except Exception:  # report start-up failure instead of dying silently
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            out = fn(*args, **kwargs)
            results.put((rank, True, out))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


# What every rank imports anyway: loaded once in the fork server, so a rank starts as a fork of a
# process that has them instead of importing torch afresh (an 8-rank pool: ~40 s -> ~4 s here).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp"]


def _context():
    """The ranks' start method: forkserver with torch preloaded where the platform has it (the
    children are forks of a clean server process, not of the caller, so the caller's threads and
    state are not inherited -- the same guarantees spawn gives), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class RankPool:
    """``world`` gloo ranks kept alive across calls of :meth:`run`."""

    def __init__(self, world: int, timeout_s: float = 120.0, pg_timeout_s: float = 60.0):
        self.world = world
        self.timeout_s = timeout_s
        self.pg_timeout_s = pg_timeout_s
        self._procs: list[mp.Process] = []
        self._start()

    def _start(self) -> None:
        ctx = _context()
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, daemon=True,
                        args=(r, self.world, port, self._tasks[r], self._results, self.pg_timeout_s))
            for r in range(self.world)
        ]
        for p in self._procs:
            p.start()
        self._collect(timeout_s=max(self.timeout_s, 180.0))

    def _collect(self, timeout_s: float) -> list[Any]:
        outs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(outs) + len(errors) < self.world:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if p.exitcode is not None and r not in outs]
                late = time.monotonic() > (deadline if not errors else min(deadline, self._first_error + 10))
                if not dead and not late:
                    continue
                missing = sorted(set(range(self.world)) - set(outs) - set(errors))
                self.close(force=True)
                why = f"ranks {dead} exited" if dead else f"no answer within {timeout_s:.0f}s"
                detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
                raise DistributedRunError(f"ranks {missing} did not finish ({why}); pool torn down{detail}") from None
            if not ok and not errors:
                self._first_error = time.monotonic()
            (outs if ok else errors)[rank] = value
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise DistributedRunError(f"{len(errors)} of {self.world} ranks failed:{detail}")
        return [outs[r] for r in range(self.world)]

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable, *args, **kwargs) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; returns the per-rank results in rank order."""
        if not self.alive:
            self.close(force=True)
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        try:
            return self._collect(self.timeout_s)
        except DistributedRunError:
            # one rank failed: the others may be stuck in a collective; start fresh next time
            self.close(force=True)
            raise

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self._tasks:
                q.put(None)
        for p in self._procs:
            p.join(timeout=0 if force else 10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
