"""Profiled op times on disk, keyed by device: the correction that overrides the roofline.

One CSV per device key (e.g. ``cpu-Intel_Xeon-t2``, ``cuda-NVIDIA_H100_80GB_HBM3``) with one row per
distinct op call (``key`` from :class:`cost_models.ops.OpSpec`). New measurements replace old
rows with the same key. Lookups are exact: an op not in the table falls back to the roofline.
"""
from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from cost_models.errors import CalibrationError
from cost_models.hardware.host import cache_dir, host_key
from cost_models.ops import OpSpec

log = logging.getLogger(__name__)

COLUMNS = ["key", "op", "time_s", "reps", "spread"]


def device_key(device="cpu") -> str:
    """Cache key for the device kind this process would profile on."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return f"cpu-{host_key()}"
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        mod = getattr(torch, dev.type, None)
        name = mod.get_device_name(dev) if mod is not None and hasattr(mod, "get_device_name") else dev.type
    return f"{dev.type}-" + "".join(c if c.isalnum() else "_" for c in name)


def default_path(device_name: str) -> Path:
    return cache_dir() / "profiles" / f"{device_name}.csv"


class ProfileTable:
    """Measured seconds per op key for one device."""

    def __init__(self, device: str, frame: pd.DataFrame | None = None):
        self.device = device
        frame = frame if frame is not None else pd.DataFrame(columns=COLUMNS)
        missing = [c for c in ("key", "time_s") if c not in frame.columns]
        if missing:
            raise CalibrationError(f"ProfileTable(frame=...): missing columns {missing}")
        frame = frame[frame["time_s"].notna()]
        self.frame = frame.drop_duplicates("key", keep="last").set_index("key", drop=False)

    def __len__(self) -> int:
        return len(self.frame)

    def __contains__(self, spec: OpSpec | str) -> bool:
        return (spec.key if isinstance(spec, OpSpec) else spec) in self.frame.index

    def lookup(self, spec: OpSpec | str) -> float | None:
        key = spec.key if isinstance(spec, OpSpec) else spec
        if key in self.frame.index:
            return float(self.frame.at[key, "time_s"])
        return None

    def update(self, measured: pd.DataFrame) -> "ProfileTable":
        """Merge rows of :func:`cost_models.profiler.profile_ops` (new values win)."""
        cols = [c for c in COLUMNS if c in measured.columns]
        merged = pd.concat([self.frame.reset_index(drop=True), measured[cols]], ignore_index=True)
        return ProfileTable(self.device, merged)

    def save(self, path: str | Path | None = None) -> Path:
        path = Path(path) if path is not None else default_path(self.device)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.frame.reset_index(drop=True).to_csv(path, index=False)
        return path

    @staticmethod
    def load(device: str, path: str | Path | None = None) -> "ProfileTable":
        """The table for ``device`` (empty if none was saved)."""
        path = Path(path) if path is not None else default_path(device)
        if not path.is_file():
            log.info("no profile table at %s; roofline only", path)
            return ProfileTable(device)
        try:
            return ProfileTable(device, pd.read_csv(path))
        except (ValueError, pd.errors.ParserError) as exc:
            raise CalibrationError(f"ProfileTable.load(path={str(path)!r}): unreadable: {exc}") from exc
