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


class MetricsWriter:
    """Rank 0's metrics file: ``.csv``, ``.jsonl`` (a row per step, flushed) or ``.json`` (at close)."""

    def __init__(self, path: str | Path | None, append: bool = False):
        self.path = Path(path) if path else None
        self.rows: list[dict[str, Any]] = []
        self._file = self._csv = None
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.kind = {".csv": "csv", ".jsonl": "jsonl"}.get(self.path.suffix.lower(), "json")
        if self.kind != "json":
            fresh = not (append and self.path.exists())
            self._file = open(self.path, "w" if fresh else "a", newline="")
            self._header = fresh

    def write(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self._file is None:
            return
        if self.kind == "csv":
            if self._csv is None:
                self._csv = csv.DictWriter(self._file, fieldnames=list(row))
                if self._header:
                    self._csv.writeheader()
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
