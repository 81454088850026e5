"""A c10d world of its own for a block of code, beside the process's real one.

Why: torch allows one default process group per process, and the planner's strategy probe and
verify's dry runs each need a fake default group of their own degree. Inside a launched job (after
``init_process_group``) that used to be impossible, so planning there silently lost every sharded
option. torch keeps all process-group bookkeeping in one object, ``distributed_c10d._world``,
documented as an "experimental extension point to override it" (torch's own threaded test
backend swaps it the same way). :func:`isolated_world` swaps in a fresh world for the block and
puts the real one back, untouched:

- every map the real ``_World`` keeps in module globals (pg_map, pg_names, pg_group_ranks,
  pg_backend_config, tags_to_pg, pg_to_tag, group_count) is per instance in :class:`_OwnWorld`;
- process groups are also registered by *name* in a process-wide C++ registry (functional
  collectives and DTensor resolve groups through it). The real groups' names are unregistered for
  the block -- a name of the block can then never collide with one of theirs (torch raises on a
  duplicate), and a stray use of a real group by name inside the block fails loudly instead of
  reaching the user's group -- and registered again on exit, after the block's own groups are
  shut down and unregistered one by one. ``_unregister_all_process_groups`` (what
  ``destroy_process_group()`` calls) is never used: it would drop the user's groups too;
- the block's counter-named groups are numbered from a large per-block offset, so a stale object
  of the block (a mesh, a DTensor spec) names a group nobody has after exit rather than a real one;
- the other globals ``init_process_group`` writes (``_backend``, ``_default_pg_init_method``, the
  C++ global rank used for log prefixes, ``sys.excepthook``), DTensor's RNG tracker and the device
  mesh stack are saved and restored, and DTensor's sharding caches are cleared on entry and exit
  (their keys compare meshes by ranks and shape, not by group, so a cached decision could lend a
  fake mesh to a real DTensor or the reverse).

Nothing in here talks to the real groups: no collective, no store access, so every rank can run it
on its own, any number of times, without deadlock or traffic. The swap is process-wide (as torch's
``_world`` is): other threads must not issue collectives while a block runs.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
from typing import Iterator

import torch
from torch.distributed import device_mesh
from torch.distributed import distributed_c10d as c10d
from torch.distributed.tensor import _random as dtensor_random

from hyper_parallel.errors import WorldIsolationError
from hyper_parallel.local.dtensor_caches import clear_dtensor_caches

log = logging.getLogger(__name__)

# group names of block k start at k * _NAME_OFFSET: far above any counter a real job reaches
_NAME_OFFSET = 1_000_000
_blocks = itertools.count(1)
_lock = threading.Lock()


class _OwnWorld(c10d._World):
    """torch's ``_World`` with every map held by the instance instead of module globals."""

    def __init__(self, first_group_number: int) -> None:
        super().__init__()
        self._pg_map: dict = {}
        self._pg_names: dict = {}
        self._pg_group_ranks: dict = {}
        self._pg_backend_config: dict = {}
        self._tags_to_pg: dict = {}
        self._pg_to_tag: dict = {}
        self._group_count = first_group_number

    pg_map = property(lambda self: self._pg_map)
    pg_names = property(lambda self: self._pg_names)
    pg_group_ranks = property(lambda self: self._pg_group_ranks)
    pg_backend_config = property(lambda self: self._pg_backend_config)
    tags_to_pg = property(lambda self: self._tags_to_pg)
    pg_to_tag = property(lambda self: self._pg_to_tag)

    @property
    def group_count(self) -> int:
        return self._group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._group_count = value


_REQUIRED = ("_World", "_world", "_backend", "_default_pg_init_method", "_register_process_group",
             "_unregister_process_group")


def _check_isolatable() -> None:
    """Refuse, with the reason and the way out, where swapping the world would not isolate."""
    missing = [name for name in _REQUIRED if not hasattr(c10d, name)]
    if missing:
        raise WorldIsolationError(
            f"isolated_world: torch {torch.__version__} has no torch.distributed.distributed_c10d."
            f"{', .'.join(missing)} (the c10d state this isolation swaps); plan with the pinned torch, or in a "
            f"separate process and pass the plan file")
    world = c10d._world
    if not isinstance(world, c10d._World):
        raise WorldIsolationError(
            f"isolated_world: this process's c10d world is a {type(world).__module__}.{type(world).__name__}, "
            f"not torch's _World (e.g. the thread-local world of torch's threaded test backend); a process-wide "
            f"swap would change the groups of every thread it serves. Plan outside that world (before it starts, "
            f"or in a separate process), or pass a plan file")


@contextlib.contextmanager
def isolated_world() -> Iterator[c10d._World]:
    """Run the block in a fresh, empty c10d world (no default group: start one inside, e.g. a
    fake one); on exit the block's groups are shut down and the process's world is exactly as
    before. Blocks nest. Raises :class:`~hyper_parallel.errors.WorldIsolationError` where the
    swap cannot isolate (see :func:`_check_isolatable`)."""
    _check_isolatable()
    with _lock:
        block = next(_blocks)
    real = c10d._world
    saved = _Saved.take(real)
    clear_dtensor_caches()
    own = _OwnWorld(block * _NAME_OFFSET)
    c10d._world = own
    try:
        yield own
    finally:
        try:
            _close(own)
        finally:
            c10d._world = real
            saved.restore()
            clear_dtensor_caches()


def _close(own: _OwnWorld) -> None:
    """Shut down and unregister the block's own groups (only theirs)."""
    for pg in sorted(own.pg_names, key=lambda g: own.pg_names[g], reverse=True):
        try:
            pg.shutdown()
        except Exception as e:  # noqa: BLE001 - a fake group's shutdown should not fail; go on
            log.debug("isolated_world: shutting down %s: %s", own.pg_names[pg], e)
        _unregister(own.pg_names[pg])
    own.comms.clear()
    own.pg_coalesce_state.clear()
    for table in (own.pg_map, own.pg_names, own.pg_group_ranks, own.pg_backend_config, own.pg_to_tag,
                  own.tags_to_pg):
        table.clear()
    own.default_pg = None


def _unregister(name: str) -> bool:
    try:
        c10d._unregister_process_group(name)
        return True
    except RuntimeError:  # not registered (destroyed already, or never registered)
        return False


class _Saved:
    """Everything outside ``_world`` that starting a default group writes, and the real groups'
    names (unregistered for the block, registered again by :meth:`restore`)."""

    def __init__(self, real) -> None:
        self.real = real
        self.globals = {name: getattr(c10d, name) for name in ("_backend", "_default_pg_init_method")}
        self.excepthook = sys.excepthook
        default = real.default_pg
        self.global_rank = default.rank() if default is not None and default != c10d.GroupMember.NON_GROUP_MEMBER \
            else -1
        self.rng_tracker = _rng_module()._rng_tracker
        self.mesh_stack = list(_mesh_stack())
        self.names: list[tuple[str, object]] = []

    @classmethod
    def take(cls, real) -> "_Saved":
        saved = cls(real)
        for pg, name in list(real.pg_names.items()):
            if _unregister(name):
                saved.names.append((name, pg))
        return saved

    def restore(self) -> None:
        for name, value in self.globals.items():
            setattr(c10d, name, value)
        sys.excepthook = self.excepthook
        torch._C._distributed_c10d._set_global_rank(self.global_rank)
        _rng_module()._rng_tracker = self.rng_tracker
        _mesh_stack()[:] = self.mesh_stack
        failed = []
        for name, pg in self.names:
            try:
                c10d._register_process_group(name, pg)
            except RuntimeError as e:
                failed.append(f"{name!r}: {e}")
        if failed:
            raise WorldIsolationError(
                f"isolated_world: could not register the process's own groups again after the block "
                f"({'; '.join(failed)}); something inside the block registered a group under a real group's "
                f"name outside torch.distributed's world. Restart the job and plan in a separate process "
                f"(pass the plan file)")


def _rng_module():
    return dtensor_random


def _mesh_stack() -> list:
    return device_mesh._mesh_resources.mesh_stack
