"""A keyed digest over a checkpoint's manifest, for teams that load only checkpoints they wrote.

The manifest's CRC-32s prove that the bytes are those that were written (torn writes, bit rot);
they prove nothing about who wrote them -- anyone can edit a file and recompute its entry. With a
key (``--checkpoint-key FILE``, or the key itself in ``$AUTOPLAN_CHECKPOINT_KEY``) a save also
records every file's SHA-256 (a CRC-32 can be matched by changing four bytes, a SHA-256 cannot) and
an HMAC-SHA256 of the whole manifest made with the key; a load with a key refuses a manifest whose
HMAC is missing or does not match before any of its files is read. The key never leaves this
process: neither the checkpoint nor ``train_state.json`` holds it (the config records the key
file's path only).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from autoplan.train.errors import TrainConfigError

ENV = "AUTOPLAN_CHECKPOINT_KEY"
FIELD = "hmac_sha256"


def resolve(key_file: str | None = None) -> bytes | None:
    """The key: the bytes of ``key_file`` (a trailing newline dropped), else ``$AUTOPLAN_CHECKPOINT_KEY``,
    else None (integrity only). An unreadable or empty key is a TrainConfigError: a team that asked
    for authenticity must not silently get none."""
    if key_file is not None:
        try:
            key = Path(key_file).read_bytes().rstrip(b"\r\n")
        except OSError as e:
            raise TrainConfigError(f"--checkpoint-key {key_file!r}: unreadable ({e.strerror or e}); give a "
                                   f"file holding the key, or set ${ENV} to it") from None
        if not key:
            raise TrainConfigError(f"--checkpoint-key {key_file!r}: the file is empty; a key of at least "
                                   "16 bytes is expected")
        return key
    value = os.environ.get(ENV)
    if value is None:
        return None
    if not value:
        raise TrainConfigError(f"${ENV} is set but empty; unset it, or set it to a key of at least 16 bytes")
    return value.encode()


def _canonical(body: dict[str, Any]) -> bytes:
    """The manifest's bytes as signed: its JSON without the digest itself, keys sorted, no spaces
    (independent of how the file is indented)."""
    return json.dumps({k: v for k, v in body.items() if k != FIELD}, sort_keys=True, separators=(",", ":")).encode()


def sign(body: dict[str, Any], key: bytes) -> str:
    """The HMAC-SHA256 (hex) of ``body`` under ``key``."""
    return hmac.new(key, _canonical(body), hashlib.sha256).hexdigest()


def refusal(body: dict[str, Any], key: bytes) -> str | None:
    """Why ``body`` is not a manifest written with ``key`` (None: it is)."""
    found = body.get(FIELD)
    if not isinstance(found, str):
        return (f"no keyed digest ({FIELD}): written without --checkpoint-key, or the digest was removed; "
                "with a key only checkpoints written with that key load")
    if not hmac.compare_digest(found, sign(body, key)):
        return (f"its keyed digest ({FIELD}) does not match this key: written with another key, or the "
                "manifest was changed after it was written")
    unhashed = [name for name, entry in body.get("files", {}).items() if "sha256" not in entry]
    if unhashed:
        return f"file {unhashed[0]!r} has no SHA-256 in a signed manifest; only a SHA-256 binds a file to the key"
    return None
