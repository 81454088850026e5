"""Collective calibration: time collectives on real process groups and fit alpha and beta.

Ranks come from a RankPool (gloo on CPU here; the same code runs on nccl/hccl groups). Each
(kind, size) is timed with a barrier before every repetition and the slowest rank's time is kept.
The fit solves time = alpha x latency_steps + wire_bytes / bandwidth by least squares on relative
error, with the step and byte counts of :func:`cost_models.collectives.collective_terms`, so the
fitted link plugs straight back into the model. Sizes alternate between a fit set and a held-out
set so every fit reports its error on sizes it never saw.
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable, Sequence

import pandas as pd

from cost_models.collectives import collective_terms
from cost_models.errors import CalibrationError
from cost_models.hardware.profile import Link
from hyper_parallel.local import RankPool

log = logging.getLogger(__name__)

DEFAULT_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DEFAULT_SIZES = tuple(2 ** k for k in range(10, 25, 1))  # 1 KiB .. 16 MiB


def _run_once(kind: str, nbytes: int, bufs) -> None:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    full, part, spare = bufs
    if kind == "all_reduce":
        dist.all_reduce(full)
    elif kind == "all_gather":
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(full, part)
    elif kind == "reduce_scatter":
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(part, full)
    elif kind == "all_to_all":
        dist.all_to_all_single(spare, full)
    elif kind == "send_recv":
        # ranks pair up (0<->1, 2<->3 ...): even ranks send, odd ranks receive
        peer = rank ^ 1
        if peer >= world:
            return
        if rank % 2 == 0:
            dist.send(full, peer)
        else:
            dist.recv(full, peer)
    else:
        raise CalibrationError(f"collective kind={kind!r} cannot be benchmarked")


def bench_collectives(kinds: Sequence[str], sizes: Sequence[int], reps: int = 10, warmup: int = 2,
                      rounds: int = 2) -> list[dict]:
    """Run on every rank of a group: time per (kind, full size in bytes), slowest rank's.

    Each size is timed in ``rounds`` passes of ``reps``; the fastest pass median is kept, which
    drops passes slowed by other processes on a shared host.

    Module-level so a RankPool can send it to its ranks. Unsupported kinds give error rows.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    rows = []
    for kind in kinds:
        for _ in range(rounds):
            for nbytes in sizes:
                n = max(world, nbytes // 4 // world * world)
                full = torch.ones(n)
                bufs = (full, torch.ones(n // world), torch.empty(n))
                times = []
                err = ""
                try:
                    for i in range(warmup + reps):
                        dist.barrier()
                        t0 = time.perf_counter()
                        _run_once(kind, nbytes, bufs)
                        dt = time.perf_counter() - t0
                        if i >= warmup:
                            times.append(dt)
                except RuntimeError as exc:  # backend without this collective
                    err = str(exc).splitlines()[0][:200]
                t = torch.tensor([statistics.median(times) if times else 0.0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                rows.append({"kind": kind, "nbytes": n * 4, "group_size": world,
                             "time_s": float(t.item()) if not err else float("nan"), "error": err})
    frame = pd.DataFrame(rows)
    best = frame.groupby(["kind", "nbytes", "group_size"], as_index=False).agg(
        time_s=("time_s", "min"), error=("error", "first"))
    return best.to_dict("records")


def fit_alpha_beta(frame: pd.DataFrame, algorithm: str = "ring") -> tuple[float, float]:
    """(alpha seconds, bandwidth bytes/s) from rows with kind, nbytes, group_size, time_s."""
    import numpy as np

    rows = frame.dropna(subset=["time_s"])
    if len(rows) < 2:
        raise CalibrationError(f"fit_alpha_beta: need >= 2 timed sizes, got {len(rows)}")
    terms = [collective_terms(k, b, n, algorithm) for k, b, n in zip(rows["kind"], rows["nbytes"], rows["group_size"])]
    a = np.array([[t.latency_steps, t.wire_bytes] for t in terms], dtype=float)
    y = rows["time_s"].to_numpy(dtype=float)
    w = 1.0 / y
    (alpha, inv_bw), *_ = np.linalg.lstsq(a * w[:, None], y * w, rcond=None)
    if inv_bw <= 0:
        raise CalibrationError(f"fit_alpha_beta: non-positive 1/bandwidth {inv_bw:.3g} for {set(rows['kind'])}")
    return max(float(alpha), 0.0), 1.0 / float(inv_bw)


def predict(frame: pd.DataFrame, alpha: float, bandwidth: float, algorithm: str = "ring") -> pd.Series:
    link = Link("fitted", bandwidth=bandwidth, latency=alpha)
    return pd.Series([collective_terms(k, b, n, algorithm).time(link)
                      for k, b, n in zip(frame["kind"], frame["nbytes"], frame["group_size"])], index=frame.index)


def fit_collectives(measured: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Fit alpha/beta per (kind, group size) on every other size; score on the sizes left out.

    Returns (fits, points): fits has kind, group_size, alpha_s, bandwidth_Bps, fit_mape, heldout_mape,
    heldout_median_ape and heldout_max_ape (one stalled size dominates a mean on a shared host);
    points adds predicted_s and a held_out flag to the measurements.
    """
    fits, parts = [], []
    for (kind, n), grp in measured.dropna(subset=["time_s"]).groupby(["kind", "group_size"]):
        grp = grp.sort_values("nbytes").reset_index(drop=True)
        held = grp.index % 2 == 1
        try:
            alpha, bw = fit_alpha_beta(grp[~held])
        except CalibrationError as exc:
            log.warning("%s", exc)
            continue
        grp = grp.assign(predicted_s=predict(grp, alpha, bw), held_out=held)
        ape = (grp["predicted_s"] - grp["time_s"]).abs() / grp["time_s"]
        fits.append({"kind": kind, "group_size": n, "alpha_s": alpha, "bandwidth_Bps": bw,
                     "fit_mape": float(ape[~held].mean()), "heldout_mape": float(ape[held].mean()),
                     "heldout_median_ape": float(ape[held].median()), "heldout_max_ape": float(ape[held].max())})
        parts.append(grp)
    if not fits:
        raise CalibrationError("fit_collectives: no collective could be fitted")
    return pd.DataFrame(fits), pd.concat(parts, ignore_index=True)


def calibrate_collectives(world: int = 2, kinds: Sequence[str] = DEFAULT_KINDS,
                          sizes: Sequence[int] = DEFAULT_SIZES, reps: int = 10,
                          progress: Callable[[str], None] | None = None, pool=None):
    """Benchmark collectives on ``world`` gloo ranks and fit them.

    Returns (fits, points, link): ``link`` is the all-reduce fit (alpha, bandwidth) as a Link to
    use for this host's intra-node level. Pass ``pool`` to reuse a running RankPool.
    """
    own = pool is None
    pool = pool or RankPool(world)
    try:
        rows = []
        for kind in kinds:
            if progress is not None:
                progress(kind)
            rows += pool.run(bench_collectives, [kind], list(sizes), reps)[0]
    finally:
        if own:
            pool.close()
    measured = pd.DataFrame(rows)
    bad = measured[measured["error"] != ""]
    for kind, msg in bad.groupby("kind")["error"].first().items():
        log.warning("collective %s not timed on this backend: %s", kind, msg)
    fits, points = fit_collectives(measured)
    ar = fits[fits["kind"] == "all_reduce"]
    row = (ar if len(ar) else fits).iloc[0]
    link = Link(f"calibrated_{row['kind']}", bandwidth=float(row["bandwidth_Bps"]), latency=float(row["alpha_s"]))
    return fits, points, link
