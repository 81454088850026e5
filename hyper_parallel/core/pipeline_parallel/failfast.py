"""Fail fast: one pipeline rank failing inside a step makes every rank of its group fail in seconds.

Without this, a rank that raised mid-schedule (Nemotron's weight pass on ranks 2-3) left its peers
blocked in a P2P receive until the process group timed out (60+ s, or 30 min by default). On gloo
neither remedy torch offers for NCCL helps: ``_abort_process_group`` returns but does not wake a
peer's pending receive, a timed ``Work.wait(timeout=...)`` spoils the receive it gave up on, and
``is_completed()`` of a gloo receive never turns true before ``wait`` (all measured here).

So the step keeps a flag in the default store: the failing rank sets the key of its group and
step (``fail``), and every wait of the schedule runs on a helper thread while the rank checks the
key each ``POLL_S`` (``wait``). A healthy wait costs one thread start (tens of microseconds); the
store is read only while a wait lasts longer than ``POLL_S``. A peer that sees the key raises
:class:`PipelinePeerFailedError` naming the failing rank and its error; its abandoned receive
stays blocked on the helper thread (a daemon) until the group times out -- the rank is failing
anyway, and the group should not be used for P2P again.
"""
from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from hyper_parallel.errors import PipelinePeerFailedError

log = logging.getLogger(__name__)
POLL_S = 0.2               # how often a waiting rank checks whether a peer failed
_PREFIX = "hyper_parallel/pipeline_failed"
_STEPS: dict[tuple[int, ...], int] = {}   # group ranks -> steps started on it (lockstep on every rank)


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default store (no group, or a backend without one): no flag
        return None


class StepFailure:
    """The failure flag of one step of a pipeline group (see the module docstring)."""

    def __init__(self, group, step: int, store, ranks: tuple[int, ...]):
        self.group, self.step, self.store = group, step, store
        self.key = f"{_PREFIX}/{'-'.join(map(str, ranks))}/{step}"
        self.rank = dist.get_rank()

    @classmethod
    def begin(cls, group) -> "StepFailure | None":
        """The flag of the next step on ``group``; None where there is nothing to poll (no process
        group, a fake group of a dry run, no store)."""
        if not dist.is_initialized() or dist.get_backend(group) == "fake":
            return None
        store = _store()
        if store is None:
            return None
        ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        _STEPS[ranks] = _STEPS.get(ranks, 0) + 1
        return cls(group, _STEPS[ranks], store, ranks)

    def fail(self, exc: BaseException) -> None:
        """Tell the group's other ranks that this rank's step failed with ``exc``."""
        try:
            if not self.store.check([self.key]):
                self.store.set(self.key, f"{self.rank}\n{type(exc).__name__}: {exc}"[:2000])
        except Exception as err:  # noqa: BLE001 - the step's own error is what must surface
            log.warning("pipeline step %d: could not flag the failure of rank %d for its peers: %s",
                        self.step, self.rank, err)

    def raise_if_failed(self) -> None:
        if not self.store.check([self.key]):
            return
        rank, _, why = self.store.get(self.key).decode(errors="replace").partition("\n")
        raise PipelinePeerFailedError(int(rank), why, self.rank)

    def wait(self, work) -> None:
        """``work.wait()``, giving up with PipelinePeerFailedError as soon as a peer flagged a failure."""
        done, box = threading.Event(), []

        def run():
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting rank
                box.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="pipeline-p2p-wait").start()
        start = time.monotonic()
        while not done.wait(POLL_S):
            self.raise_if_failed()
            log.debug("pipeline step %d: rank %d waiting %.1f s", self.step, self.rank, time.monotonic() - start)
        if box:
            self.raise_if_failed()   # a broken connection after a peer failed: name the peer
            raise box[0]
