"""Distributed checkpoints with torch DCP that load under another plan.

Parameters and AdamW state are saved by fully-qualified name of the *original* model
(``get_state_dict`` with a flattened optimizer state: ``state.<fqn>.exp_avg``), each a DTensor
with its global shape; DCP reshards on load, so a checkpoint written under (dp=2, tp=2) loads
under tp=4, under pp=2 x tp=2 or on one device. Pipeline stages keep the original FQNs
(hyper_parallel's ``split_model`` registers each unit under its original path); a rank with
several stages is presented to DCP as one module holding all its units (:func:`state_module`).

A step directory holds the DCP files plus ``train_state.json`` (step, data position, settings),
``rng.pt`` and, written last, ``manifest.json`` (every file's size and CRC-32: :mod:`.manifest`;
signed when a checkpoint key is given: :mod:`.checkpoint_key`); it is written under
``<name>.tmp`` and renamed when complete, so a crash mid-save never leaves a directory that looks
loadable, and a checkpoint is loaded only when its manifest verifies and every file is data
(:func:`.safe_load.open_checkpoint`: nothing in a checkpoint runs code). A failure reading one --
a flipped byte, a truncated shard, garbage metadata, a broken train state -- is a
CheckpointCorruptError naming the checkpoint and the file, on every rank; a file that would run
code, or an unsigned manifest under a key, a CheckpointUntrustedError. Before anything is loaded
every parameter name and global shape is checked against the checkpoint's metadata on every rank,
so a checkpoint of another model fails with :class:`CheckpointMismatchError` naming the first
mismatching parameter and leaves the model and optimizer untouched.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from autoplan.plan.held import held_module as state_module
from autoplan.train import manifest, safe_load
from autoplan.train.errors import (
    CheckpointCorruptError, CheckpointError, CheckpointMismatchError, CheckpointUntrustedError,
)
from hyper_parallel.core.dtensor.blocks import copy_back, dcp_mappable
from hyper_parallel.core.float8 import high_precision_state
from hyper_parallel.platform import device_type

log = logging.getLogger(__name__)
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_DIR = re.compile(r"^step-(\d+)$")
TRAIN_STATE = "train_state.json"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def step_dirs(root: str | Path | None) -> list[tuple[int, Path]]:
    """Every ``step-N`` directory under ``root``, newest first (complete or not; see :func:`latest`).
    Rank 0's listing when a process group is up, so every rank walks the same list collectively."""
    found: list[tuple[int, Path]] = []
    if root and Path(root).is_dir():
        found = sorted(((int(m.group(1)), p) for p in Path(root).iterdir()
                        if (m := _STEP_DIR.match(p.name)) and p.is_dir()), reverse=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    return found


def latest(root: str | Path, key: bytes | None = None) -> Path | None:
    """The newest ``step-N`` directory under ``root`` whose manifest verifies (None when none does);
    newer ones that fail are skipped with a warning naming their first bad file -- damage, which
    disks and crashes cause. A manifest not signed with ``key`` is not skipped: it raises
    CheckpointUntrustedError (a checkpoint someone else put there is reported, not passed over).
    Collective when a process group is up: every rank must call it, and every rank gets the same
    answer."""
    for _, path in step_dirs(root):
        try:
            manifest.verify(path, key=key)
        except CheckpointUntrustedError:
            raise
        except CheckpointCorruptError as e:   # every rank got the same verdict; rank 0 says it
            if not dist.is_initialized() or dist.get_rank() == 0:
                log.warning("checkpoint %s is not usable (%s: %s); trying an older one", path, e.file, e.reason)
            continue
        return path
    return None


def resolve(resume: str, root: str | Path | None, key: bytes | None = None) -> Path:
    """``resume``: ``latest`` (the newest verified under ``root``) or a step directory (verified
    when loaded). Collective for ``latest``."""
    if resume == "latest":
        if root is None:
            raise CheckpointError("train: --resume latest needs --checkpoint-dir")
        path = latest(root, key)
        if path is None:
            raise CheckpointError(f"train: --resume latest: no verified step-N checkpoint under {root} "
                                  f"({len(step_dirs(root))} step directories)")
        return path
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"train: --resume {resume!r}: no such checkpoint directory; give a step-N "
                              "directory, 'latest', 'auto' or 'never'")
    return path


def _move_aside(final: Path) -> Path:
    """Rename a step directory out of the way instead of deleting it (a save never destroys data)."""
    k = 1
    while (aside := final.with_name(f"{final.name}.replaced-{k}")).exists():
        k += 1
    os.replace(final, aside)
    log.warning("checkpoint: %s existed (not verified or from an earlier attempt); moved to %s", final, aside)
    return aside


def _collective_device() -> torch.device:
    """Where a tensor for a collective on the default group lives (nccl/hccl need the accelerator)."""
    if dist.get_backend() == "gloo":
        return torch.device("cpu")
    dev = device_type()
    return torch.device(dev, getattr(torch, dev).current_device())


class PendingSave:
    """A checkpoint whose files are written (under ``step-N.tmp``) while this rank's manifest
    entries are computed in a background thread; :meth:`finish` (collective) gathers them, writes
    the manifest and renames the directory into place.

    Why a thread: CRC-32 runs at ~2 GB/s a core, DCP writes ~0.7 GB/s here, so hashing after the
    write adds ~30 % to a save (benchmarks/checkpoint_integrity.md); the training loop instead
    polls after each following step and finishes the save once every rank's hashing is done, so
    the hashing overlaps training (on an accelerator the CPU is idle then). A crash before
    ``finish`` leaves only the ``.tmp`` directory, which nothing loads: the run resumes from the
    checkpoint before, which is why the window is kept to the few steps hashing takes."""

    def __init__(self, tmp: Path, final: Path, step: int, info: dict[str, Any], integrity: bool,
                 key: bytes | None = None):
        self.tmp, self.final, self.step, self.info, self.integrity = tmp, final, step, info, integrity
        self.key = key
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        names = manifest.rank_files(tmp, self.rank) + (
            [safe_load.METADATA, safe_load.RNG_STATE, TRAIN_STATE] if self.rank == 0 else [])
        self._entries: dict[str, Any] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._hash, args=(names,), name=f"hash-{final.name}", daemon=True)
        if integrity and sum((tmp / n).stat().st_size for n in names) < manifest.CHUNK:
            self._hash(names)   # a small share hashes in milliseconds: no window in which a crash loses it
        elif integrity:
            self._thread.start()

    def _hash(self, names: list[str]) -> None:
        try:
            self._entries = manifest.entries(self.tmp, names, sha256=self.key is not None)
        except BaseException as e:  # noqa: BLE001 - re-raised by finish() in the caller's thread
            self._error = e

    def poll(self) -> Path | None:
        """Finish if every rank's hashing is done (collective: one all-reduce), else None -- the
        training loop polls after each step, so a save blocks the loop only for its writes."""
        busy = self.integrity and self._thread.is_alive()
        done = torch.tensor(0.0 if busy else 1.0, device=_collective_device())
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self.finish() if done.item() else None

    def finish(self) -> Path:
        """Wait for the hashing, gather every rank's entries, write the manifest, rename (collective)."""
        if self.integrity and self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise CheckpointError(f"checkpoint {self.tmp}: hashing its files failed: {self._error}") from self._error
        parts: list | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(self._entries, parts, dst=0)
        if self.rank == 0:
            if self.integrity:
                files = {k: v for part in parts for k, v in part.items()}
                manifest.write(self.tmp, files, key=self.key, step=self.step, **self.info)
            if self.final.exists():
                _move_aside(self.final)
            os.replace(self.tmp, self.final)
        dist.barrier()
        log.debug("checkpoint step %d -> %s", self.step, self.final)
        return self.final


def _state_dicts(module: nn.Module, optimizer) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts as DCP writes and reads them: float8-gathered
    weights (and the optimizer state made from them) as their plain high-precision tensors, same
    storage, same names -- so a float8 run's checkpoint is a high-precision checkpoint."""
    msd, osd = get_state_dict(module, optimizer, options=OPTIONS)
    return high_precision_state(msd), high_precision_state(osd)


def begin_save(runner, root: str | Path, step: int, train_state: dict[str, Any], info: dict[str, Any] | None = None,
               integrity: bool = True, key: bytes | None = None) -> PendingSave:
    """Write this step's checkpoint files (collective: every rank calls it) and start hashing them;
    ``.finish()`` completes it. Each rank hashes the DCP files it wrote; rank 0 also writes and
    hashes ``rng.pt`` and ``train_state.json`` and, at finish, the manifest (``info``: plan mesh,
    world, model fingerprint; ``key``: signed with it). ``integrity=False`` skips the manifest --
    only to measure its cost (the result is not loadable)."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    msd, osd = _state_dicts(state_module(runner), runner.optimizer)
    # packed projections' strided shards are written as plain ones (DCP: "overlapping chunks")
    dcp.save({"model": dcp_mappable(msd)[0], "optim": dcp_mappable(osd)[0]}, checkpoint_id=str(tmp))
    if rank == 0:
        torch.save({"cpu": torch.get_rng_state()}, tmp / safe_load.RNG_STATE)
        (tmp / TRAIN_STATE).write_text(json.dumps(dict(train_state, step=step), indent=1, sort_keys=True) + "\n")
    return PendingSave(tmp, final, step, dict(info or {}), integrity, key)


def save(runner, root: str | Path, step: int, train_state: dict[str, Any], info: dict[str, Any] | None = None,
         integrity: bool = True, key: bytes | None = None) -> Path:
    """Write this step's checkpoint and wait for its manifest (collective): :func:`begin_save` + finish."""
    return begin_save(runner, root, step, train_state, info, integrity, key).finish()


def _global_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)  # a DTensor's shape is its global shape


def check_compatible(model: nn.Module, path: str | Path, metadata: Metadata | None = None) -> None:
    """Raise CheckpointMismatchError for the first parameter (model order) that the checkpoint at
    ``path`` lacks or holds with another global shape, or the first checkpoint parameter the model
    lacks. ``model`` is the whole model (every stage), so every rank reaches the same verdict.
    ``metadata``: the checkpoint's, already read (default: read here, data-only)."""
    meta = (metadata or safe_load.read_metadata(path)).state_dict_metadata
    saved = {k[len("model."):]: v for k, v in meta.items() if k.startswith("model.")}
    mine = dict(model.state_dict(keep_vars=True).items())
    for name, t in mine.items():
        if name not in saved:
            near = [k for k in saved if k.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
            raise CheckpointMismatchError(
                f"checkpoint {path}: parameter {name!r} of the model is not in the checkpoint "
                f"(it holds {len(saved)} tensors, e.g. {near or list(saved)[:3]}); is it a checkpoint of "
                "another model?", name, _global_shape(t), None)
        md = saved[name]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != _global_shape(t):
            found = tuple(md.size) if isinstance(md, TensorStorageMetadata) else type(md).__name__
            raise CheckpointMismatchError(
                f"checkpoint {path}: parameter {name!r} has shape {found} in the checkpoint, "
                f"{_global_shape(t)} in the model", name, _global_shape(t), found)
    extra = [k for k in saved if k not in mine]
    if extra:
        raise CheckpointMismatchError(
            f"checkpoint {path}: parameter {extra[0]!r} of the checkpoint is not in the model "
            f"({len(extra)} such); is it a checkpoint of another model?", extra[0], None,
            tuple(saved[extra[0]].size) if isinstance(saved[extra[0]], TensorStorageMetadata) else None)


def _train_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / TRAIN_STATE).read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            raise ValueError("no integer 'step'")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"checkpoint {path}: file {TRAIN_STATE}: unreadable ({e})", path, TRAIN_STATE,
                                     "unreadable") from None
    return state


def _wrapped(path: Path, file: str, what: str, fn):
    """Run ``fn``; a failure inside torch (DCP's CheckpointException derives from BaseException)
    becomes CheckpointCorruptError naming the checkpoint and the file."""
    try:
        return fn()
    except CheckpointError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        failures = getattr(e, "failures", None)   # CheckpointException: {rank: (error, traceback)}
        inner = next(iter(failures.values()))[0] if isinstance(failures, dict) and failures else e
        if isinstance(inner, CheckpointError):   # ours, raised inside DCP's collective steps
            raise inner from None
        first = (str(inner).strip().splitlines() or [type(inner).__name__])[0][:300]
        named = re.search(r"__\d+_\d+\.distcp", str(inner))
        file = named.group(0) if named else file
        raise CheckpointCorruptError(f"checkpoint {path}: {what} failed on {file}: {type(inner).__name__}: {first}",
                                     path, file, f"{type(inner).__name__}: {first}") from None


def load(runner, model: nn.Module, path: str | Path, key: bytes | None = None) -> dict[str, Any]:
    """Load parameters, optimizer state and RNG from ``path`` into this rank's share, resharded
    to the current plan; returns the saved train state (step, data position, ...).

    Collective. Before anything is loaded: the manifest verifies every file (signed with ``key``
    when given) and every file is data (:func:`.safe_load.open_checkpoint`; every rank gets the
    same CheckpointCorruptError or CheckpointUntrustedError naming the first bad one), the train
    state parses, and every parameter name and global shape matches (CheckpointMismatchError)."""
    path = Path(path)
    opened = safe_load.open_checkpoint(path, key=key)
    state = _train_state(path)
    if opened.manifest.get("model") and opened.manifest["model"] != manifest.fingerprint(model):
        log.debug("checkpoint %s: model fingerprint %s differs from this model's", path, opened.manifest["model"])
    check_compatible(model, path, opened.metadata)
    module = state_module(runner)
    msd, osd = _state_dicts(module, runner.optimizer)
    unstepped = _agreed(lambda: _unstepped(osd, opened.metadata.state_dict_metadata, path))
    rng = _wrapped(path, safe_load.RNG_STATE, "reading the RNG state", opened.rng_state)
    (m_plain, m_back), (o_plain, o_back) = dcp_mappable(msd), dcp_mappable(osd)
    holder = {"model": m_plain, "optim": {k: v for k, v in o_plain.items() if k not in unstepped}}
    _wrapped(path, "__*.distcp", "loading the tensors", lambda: opened.load(holder))
    copy_back(holder["model"], m_back)   # into the packed projections' strided shards
    copy_back(holder["optim"], o_back)
    set_state_dict(module, runner.optimizer, model_state_dict=msd, optim_state_dict=osd, options=OPTIONS)
    torch.set_rng_state(rng["cpu"])
    log.info("resumed from %s (step %d, verified)", path, state["step"])
    return state


def _agreed(fn):
    """``fn()`` where its CheckpointMismatchError may hold on some ranks only (each checks the
    optimizer entries of the parameters it holds: a pipeline stage's): every rank raises the lowest
    failing rank's, or none does -- the others would wait in DCP's collectives for the one that
    stopped. Collective when a process group of more than one rank is up."""
    error, out = None, None
    try:
        out = fn()
    except CheckpointMismatchError as e:
        error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, None if error is None else (str(error), error.name))
        first = next((s for s in seen if s is not None), None)
        if first is not None:
            error = CheckpointMismatchError(first[0], first[1])
    if error is not None:
        raise error
    return out


def _unstepped(osd: dict, meta, path: Path) -> set[str]:
    """The entries of ``osd`` not to read: those of a parameter the checkpoint holds no optimizer
    state for at all. Such a parameter never had a gradient before it was written (the vision
    layer after a VL model's feature layer, any unused module): AdamW made no state, and the fresh
    one torch initialises for it here is kept -- it is not stepped while it gets no gradient.
    Anything else missing is another optimizer's checkpoint (CheckpointMismatchError)."""
    flat = {k for k in meta if k.startswith("optim.")}
    by_param: dict[str, list[str]] = {}
    for key in osd:
        if key.startswith("state."):
            by_param.setdefault(key.rsplit(".", 1)[0], []).append(key)
    unstepped = {k for keys in by_param.values() if not any(f"optim.{k}" in flat for k in keys) for k in keys}
    missing = [k for k in osd if f"optim.{k}" not in flat and k not in unstepped]
    if missing or (unstepped and len(unstepped) == sum(len(v) for v in by_param.values())):
        first = (missing or sorted(unstepped))[0]
        raise CheckpointMismatchError(
            f"checkpoint {path}: optimizer entry {first!r} is not in the checkpoint ({len(missing or unstepped)} "
            "missing); was it written with another optimizer?", first)
    if unstepped:
        log.info("checkpoint %s: %d parameters had no optimizer state (no gradient before step %s); they keep "
                 "a fresh one", path, len({k.rsplit('.', 1)[0] for k in unstepped}), path.name)
    return unstepped


def gathered_state(runner) -> dict[str, Any]:
    """Every parameter and optimizer entry of the whole model as full CPU tensors, keyed like the
    checkpoint (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...); collective, the same dict on
    every rank. For checks and small models: it holds the whole model on each rank."""
    msd, osd = _state_dicts(state_module(runner), runner.optimizer)
    local = {}
    for prefix, sd in (("model", msd), ("optim", osd)):
        for k, v in sd.items():
            if isinstance(v, DTensor):
                v = v.full_tensor()
            local[f"{prefix}.{k}"] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return dict(sorted(out.items()))


def consolidated(path: str | Path, key: bytes | None = None) -> dict[str, Any]:
    """A checkpoint read back whole in this process (no process group): ``{"model.<fqn>": tensor,
    "optim.state.<fqn>.exp_avg": tensor, ...}`` exactly as saved, keyed like :func:`gathered_state`.
    For exporting a one-file copy and for checking what a resharded load produced; read like a
    resume (verified, data only, ``key``: signed with it)."""
    opened = safe_load.open_checkpoint(path, key=key, collective=False)
    whole: dict[str, Any] = {
        k: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for k, md in opened.metadata.state_dict_metadata.items()}
    _wrapped(Path(path), "__*.distcp", "loading the tensors", lambda: opened.load(whole, no_dist=True))
    return dict(sorted(whole.items()))
