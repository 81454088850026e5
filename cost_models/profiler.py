"""Times op specs on real tensors of the current device: warm-up, repetitions, median.

Each distinct (op, shapes, dtypes, args) is timed once however many times it occurs. Inputs are
random (floating point) or zeros (integers, so indices are always valid); strides are kept, so a
matmul on a transposed weight is timed as the model runs it. A time budget per op picks the
repetition count: tiny ops get many, a multi-second GEMM gets a few.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from cost_models.errors import CalibrationError
from cost_models.ops import REPLAY_DEVICE, OpSpec, TensorSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 2
    min_reps: int = 5
    max_reps: int = 100
    budget_s: float = 0.05       # target measured time per op, after warm-up
    slow_op_s: float = 0.5       # above this the first call is the warm-up, then ``slow_reps`` reps
    slow_reps: int = 3
    rounds: int = 1              # passes over all ops; an op's time is its fastest round,
                                 # which drops rounds slowed by other processes on a shared host
    statistic: str = "median"    # per-round statistic of the reps: "median", or "min" on a host so
                                 # oversubscribed that most reps are preempted (contention only adds time)


def _sync(device) -> None:
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type not in ("cpu", "meta"):
        mod = getattr(torch, dev.type, None)
        if mod is not None and hasattr(mod, "synchronize"):
            mod.synchronize()


def _resolve_op(name: str):
    import torch

    parts = name.split(".")
    if len(parts) != 3:
        raise CalibrationError(f"op name {name!r} is not 'namespace.op.overload'")
    ns, op, overload = parts
    try:
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    except AttributeError as exc:
        raise CalibrationError(f"op {name!r} does not exist in this torch build") from exc


def materialize(value, device, generator=None):
    """Turn recorded argument data back into real arguments on ``device``."""
    import torch

    if isinstance(value, TensorSpec):
        dtype = getattr(torch, value.dtype.split(".")[-1])
        stride = value.stride or None
        if stride is not None:
            t = torch.empty_strided(value.shape, stride, dtype=dtype, device=device)
        else:
            t = torch.empty(value.shape, dtype=dtype, device=device)
        if t.numel():
            if dtype.is_floating_point or dtype.is_complex:
                # fill the whole storage (expanded/strided views included) with moderate values
                base = torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,))
                base.uniform_(-1.0, 1.0, generator=generator)
            else:
                torch.as_strided(t, (t.untyped_storage().nbytes() // t.element_size(),), (1,)).zero_()
        return t
    if isinstance(value, tuple):
        if value[:1] == ("__list__",):
            return [materialize(v, device, generator) for v in value[1:]]
        return tuple(materialize(v, device, generator) for v in value)
    if value == REPLAY_DEVICE:
        return torch.device(device)
    if isinstance(value, str) and value.startswith("torch."):
        attr = getattr(torch, value[6:], None)
        if isinstance(attr, (torch.dtype, torch.memory_format, torch.layout)):
            return attr
    return value


def time_callable(fn: Callable[[], object], device="cpu", cfg: TimingConfig = TimingConfig()) -> tuple[float, int, float]:
    """(median seconds, repetitions, relative spread (IQR / median)) of ``fn``."""
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t0
    slow = first > cfg.slow_op_s
    for _ in range(0 if slow else cfg.warmup - 1):
        fn()
    _sync(device)
    reps = cfg.slow_reps if slow else int(min(cfg.max_reps, max(cfg.min_reps, cfg.budget_s / max(first, 1e-7))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    if cfg.statistic not in ("median", "min"):
        raise ValueError(f"TimingConfig.statistic={cfg.statistic!r} must be 'median' or 'min'")
    med = statistics.median(times)
    if cfg.statistic == "min":
        med = min(times)
    if len(times) >= 4:
        q = statistics.quantiles(times, n=4)
        spread = (q[2] - q[0]) / med if med > 0 else 0.0
    else:
        spread = (max(times) - min(times)) / med if med > 0 else 0.0
    return med, reps, spread


def time_op(spec: OpSpec, device="cpu", cfg: TimingConfig = TimingConfig()) -> tuple[float, int, float]:
    """Median time of one spec on ``device`` with fresh random inputs."""
    import torch

    op = _resolve_op(spec.op)
    gen = torch.Generator(device=device).manual_seed(0) if torch.device(device).type == "cpu" else None
    args = materialize(spec.args, device, gen)
    kwargs = {k: materialize(v, device, gen) for k, v in spec.kwargs}
    with torch.no_grad():
        try:
            return time_callable(lambda: op(*args, **kwargs), device, cfg)
        except (RuntimeError, TypeError, ValueError, IndexError) as exc:
            raise CalibrationError(f"time_op: {spec.key[:200]} failed on {device}: {exc}") from exc


def profile_ops(specs: Iterable[OpSpec], device="cpu", cfg: TimingConfig = TimingConfig(),
                progress: Callable[[OpSpec], None] | None = None, skip_errors: bool = True):
    """Time every distinct spec; returns a pandas DataFrame (one row per spec).

    Columns: key, op, phase, count, time_s, reps, spread, error. ``progress`` is called once per
    spec and round. Specs that fail to replay are
    kept with an ``error`` message (and NaN time) when ``skip_errors``; otherwise they raise.
    """
    import pandas as pd

    specs = list(specs)
    rows = [{"key": s.key, "op": s.op, "phase": s.phase, "count": s.count, "time_s": float("nan"),
             "reps": 0, "spread": float("nan"), "error": ""} for s in specs]
    for rnd in range(max(1, cfg.rounds)):
        for spec, row in zip(specs, rows):
            if row["error"]:
                continue
            try:
                med, reps, spread = time_op(spec, device, cfg)
            except CalibrationError as exc:
                if not skip_errors:
                    raise
                log.warning("%s", exc)
                row["error"] = str(exc)[:300]
                continue
            if not med >= row["time_s"]:  # first round (NaN) or a faster round
                row["time_s"], row["spread"] = med, spread
            row["reps"] += reps
            if progress is not None:
                progress(spec)
    return pd.DataFrame(rows)
