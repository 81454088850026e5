"""Checkpoints tampered with the way an attacker would, for tests/train/test_untrusted_checkpoints.py.

Every tampering recomputes the manifest afterwards (it is a checksum, not a signature), so only
what the loader does with the files' content stands between them and code execution. The payload
creates a marker file when unpickled: a test asserts the marker never appears.
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from autoplan.train import manifest, safe_load


class Payload:
    """Unpickling it opens ``marker`` for writing, i.e. creates the file: code from the checkpoint ran."""

    def __init__(self, marker: str | Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def rehash(ck: Path, key: bytes | None = None) -> None:
    """Recompute the manifest from the files as they are now (signed with ``key`` when given)."""
    body = manifest.read(ck)
    info = {k: v for k, v in body.items() if k not in ("files", "format", "hash", "hmac_sha256")}
    manifest.write(ck, manifest.entries(ck, list(body["files"]), sha256=key is not None), key=key, **info)


def as_pickle(ck: Path, name: str, marker: str | Path) -> str:
    """Replace file ``name`` by a plain pickle of the payload (what the issue's attacker did to ``.metadata``)."""
    (ck / name).write_bytes(pickle.dumps(Payload(marker)))
    rehash(ck)
    return name


def as_torch_save(ck: Path, name: str, marker: str | Path) -> str:
    """Replace file ``name`` by a torch.save archive holding the payload (a well-formed ``rng.pt`` look-alike)."""
    torch.save({"cpu": Payload(marker)}, ck / name)
    rehash(ck)
    return name


def byte_item_shard(ck: Path) -> str:
    """The first shard (by name) holding non-tensor entries."""
    md = safe_load.read_metadata(ck)
    return min(info.relative_path for idx, info in md.storage_data.items()
               if isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata))


def poison_byte_items(ck: Path, marker: str | Path) -> str:
    """In the first shard holding non-tensor entries (the optimizer's hyper-parameters, which DCP's
    default planner reads with ``torch.load(weights_only=False)``), replace each such entry by a
    torch.save of the payload, moving the other items and rewriting the metadata's offsets to
    match: a shard DCP itself would load, running the payload. Returns the shard's name."""
    md = safe_load.read_metadata(ck)
    name = byte_item_shard(ck)
    raw = (ck / name).read_bytes()
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    out = bytearray()
    items = sorted(((idx, info) for idx, info in md.storage_data.items() if info.relative_path == name),
                   key=lambda item: item[1].offset)
    for idx, info in items:
        poisoned = isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata)
        blob = buf.getvalue() if poisoned else raw[info.offset:info.offset + info.length]
        info.offset, info.length = len(out), len(blob)
        out += blob
    (ck / name).write_bytes(bytes(out))
    (ck / safe_load.METADATA).write_bytes(pickle.dumps(md))
    rehash(ck)
    return name


def drop_exp_avg(ck: Path, fqn: str) -> None:
    """Remove one parameter's ``exp_avg`` from the metadata (its other optimizer entries stay): a
    checkpoint only the ranks holding that parameter can see is wrong."""
    md = safe_load.read_metadata(ck)
    gone = f"optim.state.{fqn}.exp_avg"
    del md.state_dict_metadata[gone]
    md.storage_data = {idx: info for idx, info in md.storage_data.items() if idx.fqn != gone}
    (ck / safe_load.METADATA).write_bytes(pickle.dumps(md))
    rehash(ck)


def snapshot(ck: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in ck.iterdir()}


def restore(ck: Path, saved: dict[str, bytes]) -> None:
    for name, data in saved.items():
        (ck / name).write_bytes(data)
