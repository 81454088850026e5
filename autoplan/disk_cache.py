"""The planner's disk cache: results that are a function of their key and of the code computing
them, kept across processes so a fresh interpreter (one ``autoplan plan`` on the command line, a
new notebook kernel, rank 0 of a job) does not recompute them.

Why it is safe under change: every entry lives under a *version* -- a hash of the source files of
the code that computed it and of every other source file of autoplan, hyper_parallel and
cost_models (what a result depends on reaches further than any list of files: a pipeline guard
verdict went stale when stage code outside its list changed), plus the Python, torch and
transformers versions -- and a key naming everything else it depends on; code or a dependency
that changes lands in another directory, so a stale entry is never read. Why it is safe with concurrent processes: an entry is written to a
temporary file in its directory and renamed over the final name (``os.replace`` is atomic), so a
reader sees a whole entry or none; two writers of one key write the same bytes. A missing,
unreadable or unwritable cache is a miss, never an error: the caller computes as without a cache.

Where: ``$AUTOPLAN_CACHE_DIR/planner`` (default ``~/.cache/autoplan/planner``; the test suite
pins ``AUTOPLAN_CACHE_DIR`` to a fresh directory per session). ``AUTOPLAN_DISK_CACHE=0`` turns it
off (reads and writes).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from cost_models.hardware.host import cache_dir

log = logging.getLogger(__name__)


def enabled() -> bool:
    return os.environ.get("AUTOPLAN_DISK_CACHE", "1") != "0"


@functools.lru_cache(maxsize=None)
def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


SOURCE_PACKAGES = ("autoplan", "hyper_parallel", "cost_models")


@functools.lru_cache(maxsize=None)
def source_tree() -> bytes:
    """A hash of every Python source file of this project's packages (a few ms, once a process)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for pkg in SOURCE_PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.digest()


@functools.lru_cache(maxsize=None)
def code_version(*files: str) -> str:
    """A hash of ``files``' bytes (the code that computes an entry), of the project's whole source
    tree and of the interpreter, torch and transformers versions: the directory an entry lives in."""
    h = hashlib.sha256()
    h.update(f"{sys.version_info[:3]} {sys.byteorder} torch {_dist_version('torch')} "
             f"transformers {_dist_version('transformers')}".encode())
    h.update(source_tree())
    for f in sorted(files):
        h.update(f.encode() + b"\0" + Path(f).read_bytes() + b"\0")
    return h.hexdigest()[:20]


def _path(kind: str, version: str, key: str) -> Path:
    return cache_dir() / "planner" / kind / version / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".bin")


def load(kind: str, version: str, key: str) -> bytes | None:
    """The entry's bytes, or None (a miss, a disabled cache, an unreadable file)."""
    if not enabled():
        return None
    try:
        return _path(kind, version, key).read_bytes()
    except OSError:
        return None


def store(kind: str, version: str, key: str, data: bytes) -> None:
    """Write the entry atomically (temporary file + rename); a failure is logged and ignored."""
    if not enabled():
        return
    path = _path(kind, version, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.debug("disk cache: could not write %s: %s", path, e)
