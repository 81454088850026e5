"""Per-step metrics of a training run: throughput, MFU, memory, and the file they go to.

MFU is model FLOPs (PaLM's 6N + 12LHQT per token, :func:`autoplan.train.model.flops_per_token`)
per second over the world's peak FLOP/s from the plan's hardware profile, so it reads the same way
as torchtitan's. The metrics file is written by rank 0 only, one row per step as it happens
(CSV or JSON lines, flushed) or the whole list at the end (``.json``).
"""
from __future__ import annotations

import csv
import json
import logging
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from cost_models.hardware import load_hardware
from cost_models.hardware.host import cache_dir, host_key

log = logging.getLogger(__name__)


def peak_flops(hardware: str | None, dtype: torch.dtype) -> float | None:
    """Peak dense FLOP/s of one device of ``hardware`` for ``dtype``; None when unknown.

    The ``cpu`` profile is used only when this host's measurement is already cached (``autoplan
    hardware``/``calibrate`` write it): measuring inside a job would time GEMMs on every busy rank."""
    if not hardware:
        return None
    try:
        if hardware == "cpu" and not (cache_dir() / "hardware" / f"cpu-{host_key()}.json").is_file():
            log.info("train: this host's cpu profile is not measured yet (threads=%d); MFU not reported",
                     torch.get_num_threads())
            return None
        return float(load_hardware(hardware).peak(dtype))
    except Exception as e:  # noqa: BLE001 - MFU is a convenience; training goes on without it
        log.warning("train: no peak FLOP/s for hardware %r (%s); MFU not reported", hardware, e)
        return None


def memory_gib(device: torch.device) -> tuple[float, str]:
    """Peak memory of this process: accelerator memory allocated, or the CPU process's peak RSS."""
    mod = getattr(torch, device.type, None) if device.type != "cpu" else None
    if mod is not None and hasattr(mod, "max_memory_allocated"):
        return mod.max_memory_allocated(device) / 2**30, "alloc"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (kib / 2**30 if sys.platform == "darwin" else kib / 2**20), "rss"


def _read_rows(path: Path, kind: str) -> list[dict[str, Any]]:
    """The rows already in a metrics file; a torn last line (a crash mid-write) is skipped."""
    text = path.read_text()
    if kind == "csv":
        rows = []
        for r in csv.DictReader(text.splitlines()):
            try:
                rows.append({k: v for k, v in r.items() if k is not None} | {"step": int(r["step"])})
            except (TypeError, ValueError):
                log.warning("metrics: %s: skipping an unreadable row %r", path, r)
        return rows
    if kind == "jsonl":
        rows = []
        for line in text.splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                log.warning("metrics: %s: skipping an unreadable line %r", path, line[:80])
        return rows
    try:
        return list(json.loads(text))
    except ValueError:
        log.warning("metrics: %s is not readable JSON; starting it afresh", path)
        return []


class MetricsWriter:
    """Rank 0's metrics file: ``.csv``, ``.jsonl`` (a row per step, flushed) or ``.json`` (at close).

    ``start_step``: the step a resumed run starts after; rows up to it are kept, later ones -- the
    steps a crashed run did after its last checkpoint, which the resumed run does again -- are
    dropped, so every step appears once. 0 (a fresh run) starts the file afresh; ``append=True``
    keeps every row."""

    def __init__(self, path: str | Path | None, append: bool = False, start_step: int | None = None):
        self.path = Path(path) if path else None
        self.rows: list[dict[str, Any]] = []
        self._file = self._csv = None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.kind = {".csv": "csv", ".jsonl": "jsonl"}.get(self.path.suffix.lower(), "json")
        keep = start_step if start_step is not None else (float("inf") if append else 0)
        kept = [r for r in _read_rows(self.path, self.kind) if int(r["step"]) <= keep] \
            if keep and self.path.exists() else []
        dropped = keep and self.path.exists() and keep != float("inf")
        if dropped:
            log.info("metrics: %s continues after step %d (%d rows kept)", self.path, keep, len(kept))
        self.rows = kept
        if self.kind != "json":
            self._rewrite(list(kept[0]) if kept else None)

    def _rewrite(self, fields: list[str] | None) -> None:
        """(Re)write the file with the rows so far and leave it open for appending; written to a
        temporary file and renamed, so a crash here loses no row."""
        if self._file is not None:
            self._file.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", newline="") as f:
            if self.kind == "csv" and fields:
                w = csv.DictWriter(f, fieldnames=fields, restval="", extrasaction="ignore")
                w.writeheader()
                w.writerows(self.rows)
            elif self.kind == "jsonl":
                f.writelines(json.dumps(r) + "\n" for r in self.rows)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=fields, restval="", extrasaction="ignore") \
            if self.kind == "csv" and fields else None

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is None:
            return
        if self.kind == "csv":
            if self._csv is None or not set(row) <= set(self._csv.fieldnames):
                old = list(self._csv.fieldnames) if self._csv is not None else []
                self._rewrite(old + [k for k in row if k not in old])   # a new column: header again
                self._file.flush()
                return
            self._csv.writerow(row)
        else:
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self.path is None:
            return
        if self._file is not None:
            self._file.close()
        else:
            self.path.write_text(json.dumps(self.rows, indent=1) + "\n")
