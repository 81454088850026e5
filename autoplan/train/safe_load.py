"""Reading a checkpoint without running code from it: every file is data, or it is refused.

A checkpoint is data, but two of its formats are pickles, and unpickling runs whatever the pickle
names: DCP's ``.metadata`` (torch's FileSystemReader reads it with a plain ``pickle.load``) and the
non-tensor entries inside the ``__<rank>_<n>.distcp`` shards (the optimizer's hyper-parameters,
which DCP's default planner reads with ``torch.load(weights_only=False)``). The manifest does not
help against a file put there on purpose: its CRC-32s can be recomputed by anyone. So every read of
a checkpoint goes through :func:`open_checkpoint`, which admits only data:

- ``.metadata`` is unpickled by an Unpickler that resolves only what DCP's metadata is made of (its
  dataclasses, ``torch.Size``, dtypes, layouts, paths); any other import is refused by name before
  anything is imported, and the metadata may point at nothing but this checkpoint's own shards.
- every ``torch.save`` payload -- each item of each shard, ``rng.pt`` -- must be a torch.save
  archive whose pickle, disassembled without running it (torch's ``get_unsafe_globals_in_checkpoint``),
  imports nothing outside torch's weights-only allowlist; it is then loaded with ``weights_only=True``
  (DCP does so for tensors, :class:`_DataOnlyPlanner` for the other entries).

All of it is checked before anything is loaded, the files split over the ranks and the verdicts
gathered (:func:`manifest.agreed`), so every rank raises the same one-line error naming the file
and what was found, or none does -- a rank refusing alone would leave the others waiting in DCP's
collectives.
"""
from __future__ import annotations

import io
import logging
import pathlib
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
    TensorProperties, TensorStorageMetadata,
)
from torch.serialization import _get_layout, get_unsafe_globals_in_checkpoint

from autoplan.train import manifest
from autoplan.train.manifest import Verdict

log = logging.getLogger(__name__)
METADATA = ".metadata"
RNG_STATE = "rng.pt"
SHARD = re.compile(r"^__\d+_\d+\.distcp$")

_PATHS = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath)
# What DCP's Metadata pickles refer to, and nothing else: each is a dataclass, an enum, a path or a
# pure constructor, so calling it with the pickle's arguments builds a value and does nothing else.
METADATA_GLOBALS: dict[tuple[str, str], Any] = {
    **{(o.__module__, o.__qualname__): o for o in (
        Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata, ChunkStorageMetadata,
        BytesStorageMetadata, _MEM_FORMAT_ENCODING, _StorageInfo, torch.Size, _get_layout, *_PATHS)},
    **{("pathlib", p.__name__): p for p in _PATHS},   # the paths' module is pathlib._local on Python >= 3.13
    **{("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)},
}


class _Refused(Exception):
    """What a pickle would have imported, outside the allowlist (nothing was imported)."""


class _Restricted(pickle.Unpickler):
    """An Unpickler that resolves only ``allowed``: a pickle runs code only through what it imports."""

    def __init__(self, file: BinaryIO, allowed: dict[tuple[str, str], Any]):
        super().__init__(file)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found


class _Slice(io.RawIOBase):
    """A read-only view of ``length`` bytes of ``f`` from ``start``: one torch.save payload inside a
    DCP shard, read in place (its tensor bytes are not read to look at its pickle)."""

    def __init__(self, f: BinaryIO, start: int, length: int):
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


def _verdict(order: int, path: Path, file: str, reason: str, untrusted: bool) -> Verdict:
    return (order, file, reason, f"checkpoint {path}: file {file}: {reason}", untrusted)


def _payload(f: BinaryIO, what: str) -> tuple[str, bool] | None:
    """What is wrong with one torch.save payload (None: nothing), and whether it is a refusal (it
    would run code) rather than damage."""
    start = f.tell()
    head = f.read(4)
    f.seek(start)
    if head[:2] != b"PK":   # not a torch.save archive: say what a pickle would import, without importing it
        try:
            _Restricted(f, {}).load()
        except _Refused as e:
            return f"{what} is a raw pickle that would import {e} (loading it would run code)", True
        except Exception:  # noqa: BLE001 - not a pickle either: damage, reported in words
            return f"{what} is not a torch.save archive (it starts with {head!r})", False
        return f"{what} is a raw pickle, not a torch.save archive", False
    try:
        unsafe = sorted(get_unsafe_globals_in_checkpoint(f))
    except Exception as e:  # noqa: BLE001 - a damaged archive: reported in words
        return f"{what} is an unreadable torch.save archive ({type(e).__name__}: {str(e).strip()[:200]})", False
    if unsafe:
        return (f"{what} is a torch.save archive whose pickle imports {', '.join(unsafe[:3])}, outside torch's "
                "weights-only allowlist (loading it would run code)"), True
    return None


def _read_metadata(path: Path, order: int = 0) -> tuple[Metadata | None, Verdict | None]:
    try:
        with open(path / METADATA, "rb") as f:
            metadata = _Restricted(f, METADATA_GLOBALS).load()
    except _Refused as e:
        return None, _verdict(order, path, METADATA, f"a pickle that would import {e} (loading it would run code); "
                              "DCP metadata is made of its own dataclasses, torch.Size, dtypes and paths only", True)
    except OSError as e:
        return None, _verdict(order, path, METADATA, f"unreadable ({e.strerror or e})", False)
    except Exception as e:  # noqa: BLE001 - any failure unpickling is damage, reported in words
        return None, _verdict(order, path, METADATA, f"not DCP metadata ({type(e).__name__}: {str(e)[:200]})", False)
    if not isinstance(metadata, Metadata):
        return None, _verdict(order, path, METADATA, f"holds a {type(metadata).__name__}, not DCP metadata", False)
    return metadata, None


def read_metadata(path: str | Path) -> Metadata:
    """The DCP metadata of the checkpoint at ``path``, unpickled with only DCP's metadata types
    admitted; CheckpointUntrustedError (it would import anything else) or CheckpointCorruptError."""
    path = Path(path)
    metadata, found = _read_metadata(path)
    if found is not None:
        manifest.refuse(path, found)
    return metadata


def _malformed(metadata: Metadata) -> str | None:
    """What in the metadata's shape is not what DCP writes (None: nothing); the readers after this
    one take its types for granted."""
    entries, storage = getattr(metadata, "state_dict_metadata", None), getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        return "its state_dict_metadata or storage_data is not a dict"
    for fqn, md in entries.items():
        tensor = isinstance(md, TensorStorageMetadata) and isinstance(md.size, torch.Size) \
            and isinstance(getattr(md.properties, "dtype", None), torch.dtype)
        if not (tensor or isinstance(md, BytesStorageMetadata)) or not isinstance(fqn, str):
            return f"entry {fqn!r} is a {type(md).__name__}, not tensor or bytes metadata"
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo) or not all(
                isinstance(v, int) for v in (info.offset, info.length)) or not isinstance(info.relative_path, str):
            return f"storage entry {getattr(index, 'fqn', index)!r} is not an index and a file position"
    return None


def _pointers(path: Path, metadata: Metadata, shards: set[str], order: int) -> Verdict | None:
    """The metadata must be DCP's, and point only at this checkpoint's shards, without storage
    transforms (this trainer writes none; a transform would run an extension's code on the bytes)."""
    wrong = _malformed(metadata)
    if wrong is not None:
        return _verdict(order, path, METADATA, f"not DCP metadata: {wrong}", False)
    for index, info in metadata.storage_data.items():
        if info.relative_path not in shards:
            return _verdict(order, path, METADATA, f"item {index.fqn!r} points at {info.relative_path!r}, which is "
                            f"not one of this checkpoint's shards ({len(shards)} in its manifest)", True)
        if info.transform_descriptors:
            return _verdict(order, path, METADATA, f"item {index.fqn!r} names storage transforms "
                            f"{list(info.transform_descriptors)}; autoplan train writes none", True)
    return None


def _shard(path: Path, name: str, items: list[tuple[str, int, int]], order: int) -> Verdict | None:
    file = path / name
    size = file.stat().st_size
    with open(file, "rb") as f:
        if size and f.read(2) != b"PK":   # a shard starts with its first item's archive; else say what it is
            f.seek(0)
            return _verdict(order, path, name, *(_payload(f, "the file") or ("is not a DCP shard", False)))
        for fqn, offset, length in items:
            if offset < 0 or length < 0 or offset + length > size:
                return _verdict(order, path, name, f"item {fqn!r} at bytes {offset}..{offset + length} lies outside "
                                f"the file ({size} bytes): the metadata does not describe this shard", False)
            wrong = _payload(_Slice(f, offset, length), f"item {fqn!r} (at byte {offset})")
            if wrong is not None:
                return _verdict(order, path, name, *wrong)
    return None


def _rng_state(path: Path, order: int) -> Verdict | None:
    with open(path / RNG_STATE, "rb") as f:
        wrong = _payload(f, "it")
    if wrong is not None:
        return _verdict(order, path, RNG_STATE, *wrong)
    try:
        state = torch.load(path / RNG_STATE, weights_only=True)
    except Exception as e:  # noqa: BLE001 - reported in words
        return _verdict(order, path, RNG_STATE, f"unreadable ({type(e).__name__}: {str(e).strip()[:200]})", False)
    cpu = state.get("cpu") if isinstance(state, dict) else None
    if not (isinstance(cpu, torch.Tensor) and cpu.dtype == torch.uint8):
        return _verdict(order, path, RNG_STATE, f"holds a {type(state).__name__} without a uint8 'cpu' tensor, not "
                        "an RNG state", False)
    return None


def screen(path: Path, files: list[str], collective: bool) -> Metadata:
    """Check that every file of the verified checkpoint at ``path`` (``files``: its manifest's names)
    is data of its kind, the shards and ``rng.pt`` split over the ranks; returns the metadata or
    raises on every rank (collective when ``collective``)."""
    names = sorted(files)
    order = {name: i for i, name in enumerate(names)}
    metadata, found = (None, _verdict(-1, path, METADATA, "missing from the manifest", False)) \
        if METADATA not in order else _read_metadata(path, order[METADATA])
    if found is None:
        try:
            found = _pointers(path, metadata, {n for n in names if SHARD.match(n)}, order[METADATA])
        except Exception as e:  # noqa: BLE001 - fields missing from an allowed class: damage, in words
            found = _verdict(order[METADATA], path, METADATA, f"not DCP metadata ({type(e).__name__}: {e})", False)
    if found is None:
        items: dict[str, list[tuple[str, int, int]]] = {}
        for index, info in metadata.storage_data.items():
            items.setdefault(info.relative_path, []).append((index.fqn, info.offset, info.length))
        rank, world = (dist.get_rank(), dist.get_world_size()) if collective else (0, 1)
        for name in names[rank::world]:
            try:   # whatever happens here must become a verdict, or the other ranks wait for this one
                if SHARD.match(name):
                    found = _shard(path, name, sorted(items.get(name, []), key=lambda t: t[1]), order[name])
                elif name == RNG_STATE:
                    found = _rng_state(path, order[name])
            except Exception as e:  # noqa: BLE001 - a file changed or removed since it verified
                found = _verdict(order[name], path, name, f"unreadable ({type(e).__name__}: {e})", False)
            if found is not None:
                break
    found = manifest.agreed(found, collective)
    if found is not None:
        manifest.refuse(path, found)
    return metadata


class _DataOnlyReader(FileSystemReader):
    """DCP's file reader with the metadata already read and screened (:func:`screen`): DCP never
    unpickles ``.metadata`` itself, and never falls back to a per-rank ``__<rank>.metadata`` (this
    ``read_metadata`` takes no rank)."""

    def __init__(self, path: Path, metadata: Metadata):
        super().__init__(str(path))
        self._metadata = metadata

    def read_metadata(self) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class _DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading the non-tensor entries with ``weights_only=True``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint whose manifest verified and whose every file is data: what may be read from it."""

    path: Path
    manifest: dict[str, Any]
    metadata: Metadata

    def load(self, state: dict[str, Any], no_dist: bool = False) -> None:
        """``dcp.load`` into ``state`` (collective unless ``no_dist``), through the data-only reader and planner."""
        dcp.load(state, storage_reader=_DataOnlyReader(self.path, self.metadata), planner=_DataOnlyPlanner(),
                 no_dist=no_dist)

    def rng_state(self) -> dict[str, Any]:
        return torch.load(self.path / RNG_STATE, weights_only=True)


def open_checkpoint(path: str | Path, *, key: bytes | None = None, collective: bool | None = None) -> Checkpoint:
    """The one way in to a checkpoint: its manifest verified (signed with ``key`` when given), then
    every file screened as data (:func:`screen`); raises CheckpointCorruptError /
    CheckpointUntrustedError naming the checkpoint and the first bad file, on every rank, before
    anything is loaded. ``collective`` (default: a process group of more than one rank is up):
    every rank must call it."""
    path = Path(path)
    collective = manifest.is_collective(collective)
    body = manifest.verify(path, collective, key=key)
    metadata = screen(path, list(body["files"]), collective)
    return Checkpoint(path, body, metadata)
