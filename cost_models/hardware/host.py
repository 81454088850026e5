"""The ``cpu`` hardware profile, measured on this host (never at import; cached on disk).

Datasheets do not describe a shared VM's CPU, so we measure what the roofline needs: the GEMM rate
per dtype (large square matmul), the streaming bandwidth (large elementwise add), the fixed cost
of one tiny kernel and of one view, and how fast GEMM efficiency falls with small dimensions.
The links default to loopback guesses until :func:`cost_models.calibrate.calibrate_collectives`
writes fitted values into the same cache.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

from cost_models.errors import CalibrationError
from cost_models.hardware.profile import Efficiency, HardwareProfile, Link

log = logging.getLogger(__name__)

_GEMM_SWEEP = (64, 128, 256, 512)
_GEMM_BIG = 1536


def cache_dir() -> Path:
    """Where measured profiles live: $AUTOPLAN_CACHE_DIR or ~/.cache/autoplan."""
    root = os.environ.get("AUTOPLAN_CACHE_DIR") or Path.home() / ".cache" / "autoplan"
    return Path(root)


def host_key() -> str:
    """Identifies this host for cache purposes: CPU model and the torch thread count."""
    import torch

    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    safe = "".join(c if c.isalnum() else "_" for c in model).strip("_")[:60]
    return f"{safe}-t{torch.get_num_threads()}"


def _median_time(fn, reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _gemm_rate(n: int, dtype, reps: int) -> float:
    import torch

    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2.0 * n**3 / _median_time(lambda: torch.mm(a, b), reps)


def _fit_dim_half(rates: dict[int, float], peak: float) -> float:
    """d0 minimising the log error of rate(n) = peak * (n / (n + d0))**3 over the sweep."""
    import math

    best, best_err = 0.0, float("inf")
    for d0 in [2.0**(i / 4) for i in range(0, 48)]:
        err = sum((math.log(peak * (n / (n + d0)) ** 3) - math.log(r)) ** 2 for n, r in rates.items())
        if err < best_err:
            best, best_err = d0, err
    return best


def _fit_cache(reps: int, dram_bw: float, overhead: float) -> tuple[float, float, float]:
    """Fit (cache_bytes, cache_bandwidth, sharpness) of Efficiency.bandwidth to adds of growing size.

    Time = overhead + bytes / bandwidth(bytes); log-error grid search.
    """
    import math

    import torch

    points = []
    for log2n in range(13, 23):
        n = 1 << log2n
        x, y = torch.randn(n), torch.randn(n)
        points.append((12.0 * n, _median_time(lambda: torch.add(x, y), reps * 3)))
    best, best_err = (0.0, 0.0, 3.0), float("inf")
    for i in range(28):
        half = 2.0 ** (16 + i / 4)
        for bw_i in range(12):
            top = dram_bw * 2.0 ** (0.5 + bw_i / 3)
            for sharp in (2.0, 3.0, 4.0, 6.0):
                eff = Efficiency(memory=1.0, cache_bytes=half, cache_bandwidth=top, cache_sharpness=sharp)
                err = sum((math.log(overhead + b / eff.bandwidth(dram_bw, b)) - math.log(t)) ** 2
                          for b, t in points)
                if err < best_err:
                    best, best_err = (half, top, sharp), err
    return best


def _memory_capacity() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def measure_host_profile(reps: int = 7) -> HardwareProfile:
    """Measure this host now (about 5-10 s). Use :func:`measure_host` for the cached version."""
    import torch

    peaks: dict[str, float] = {}
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        try:
            peaks[key] = _gemm_rate(_GEMM_BIG, dtype, reps)
        except RuntimeError as exc:  # a dtype without a CPU GEMM kernel on this build
            log.info("host: no %s GEMM (%s)", key, exc)
    if "fp32" not in peaks:
        raise CalibrationError("measure_host_profile: fp32 GEMM could not be timed on this host")
    sweep = {n: _gemm_rate(n, torch.float32, reps) for n in _GEMM_SWEEP}
    rates = {**sweep, _GEMM_BIG: peaks["fp32"]}
    # Fit d0 with the peak as a free scale: try the big-GEMM rate corrected for its own d0 factor.
    d0 = _fit_dim_half(rates, peaks["fp32"])
    for _ in range(3):
        scale = 1.0 / (_GEMM_BIG / (_GEMM_BIG + d0)) ** 3
        d0 = _fit_dim_half(rates, peaks["fp32"] * scale)
    scale = 1.0 / (_GEMM_BIG / (_GEMM_BIG + d0)) ** 3
    peaks = {k: v * scale for k, v in peaks.items()}

    n = 1 << 24  # 64 MiB of fp32 per operand: well past any cache
    x, y = torch.randn(n), torch.randn(n)
    out = torch.empty(n)
    t_add = _median_time(lambda: torch.add(x, y, out=out), reps)
    bandwidth = 3 * 4 * n / t_add
    tiny = torch.ones(1)
    overhead = _median_time(lambda: torch.add(tiny, tiny), 200, warmup=20)
    cache_bytes, cache_bw, sharp = _fit_cache(reps, bandwidth, overhead)
    view_overhead = _median_time(lambda: tiny.view(1, 1), 200, warmup=20)
    eff = Efficiency(compute=1.0, memory=1.0, dim_half=d0, kernel_overhead=overhead,
                     view_overhead=view_overhead, link=1.0, cache_bytes=cache_bytes, cache_bandwidth=cache_bw,
                     cache_sharpness=sharp)
    loopback = Link("loopback_gloo", bandwidth=2e9, latency=50e-6)
    prof = HardwareProfile(
        name="cpu", vendor=platform.machine(), device_type="cpu", peak_flops=peaks,
        memory_bandwidth=bandwidth, memory_capacity=_memory_capacity(), devices_per_node=1,
        intra_node=loopback, inter_node=loopback, efficiency=eff,
        sources=(f"measured on this host ({host_key()}) by cost_models.hardware.host at "
                 f"{time.strftime('%Y-%m-%d %H:%M:%S')}",),
        notes="peaks are extrapolated to an ideal-size GEMM from the dim_half fit; links are loopback "
              "guesses until calibrate_collectives replaces them",
    )
    log.info("measured host profile: %s", prof)
    return prof


def _cache_path() -> Path:
    return cache_dir() / "hardware" / f"cpu-{host_key()}.json"


def save_host_profile(profile: HardwareProfile) -> Path:
    """Write the profile whole or not at all (a temporary file renamed over the old one): a
    process reading the cache never sees half of it."""
    path = _cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1))
    os.replace(tmp, path)
    return path


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold an exclusive lock on ``path``.lock while measuring: the ranks of a job started on one
    host plan at the same time, and each measuring the host itself -- under the others' load --
    gave them different profiles, hence different plans. With the lock one rank measures and the
    others read what it wrote. (No lock where ``fcntl`` is missing: each then measures.)"""
    try:
        import fcntl
    except ImportError:   # not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _read_cached(path: Path) -> HardwareProfile | None:
    if not path.is_file():
        return None
    try:
        return HardwareProfile.from_dict(json.loads(path.read_text()))
    except (ValueError, CalibrationError) as exc:
        log.warning("ignoring unreadable host profile cache %s: %s", path, exc)
        return None


def measure_host(force: bool = False) -> HardwareProfile:
    """The cached host profile, measuring (and caching) it first if absent or if ``force``; one
    process per host measures at a time, and one that waited reads the profile just written."""
    path = _cache_path()
    prof = None if force else _read_cached(path)
    if prof is not None:
        return prof
    with _exclusive(path):
        prof = None if force else _read_cached(path)
        if prof is None:
            prof = measure_host_profile()
            save_host_profile(prof)
    return prof
