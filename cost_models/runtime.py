"""Runtime costs of eager ranks on this host, measured where the ranks really run.

The ``cpu`` hardware profile (:mod:`cost_models.hardware.host`) is measured by one process that
owns the whole host. Training ranks do not: ``world`` gloo ranks share the host's cores, every
eager op pays Python dispatch and an autograd node, an op on DTensor arguments pays sharding
propagation on top, and a gloo collective's latency is set by how fast all ``world`` processes
get scheduled, not by loopback bandwidth. :func:`calibrate_runtime` measures each of these on
``world`` ranks running concurrently and caches them per (host, world):

- ``op_s``: seconds per kernel of a forward + backward of small Linear/tanh layers, counted the
  way the planner counts kernels (three per forward non-view op: forward and two backward);
- ``dtensor_op_s``: the extra per kernel when the same layers run on replicated DTensors (no
  communication, so it is pure dispatch);
- ``compute_scale``: measured GEMM time over the profile's FLOP-rate time, geometric mean over
  GEMM sizes 128..512 run on all ranks at once (cores shared by ranks, one thread per rank);
- ``memory_scale``: the same for streaming ops (add, mul, silu, exp, rsqrt on 64K..1M floats),
  measured time over bytes / the profile's memory bandwidth. Recorded, not used by the planner:
  these run from cache (~0.2 here) while a model's memory-bound eager ops (strided, views,
  small) track ``compute_scale`` far better (4-rank step of a small Llama: 3.8 ms predicted with
  it vs 17 ms measured; 15 ms without);
- ``link``: alpha (per latency step) and bandwidth fitted, with the ring step/byte counts, to
  all-reduce, all-gather and reduce-scatter timed on all ranks at once;
- ``collective_s``: the extra per collective, over its alpha-beta time, when it is issued through
  DTensor between bursts of eager compute, as in a training step: the Python cost of the
  redistribute plus the time a rank waits for peers that the scheduler has not run yet (with more
  ranks than cores, ranks drift apart during compute; the tight-loop calibration of ``link`` does
  not see that). Measured as (compute burst + all-reduce) - (compute burst alone) - alpha-beta;
- ``optimizer_tensor_s`` / ``optimizer_dtensor_tensor_s``: AdamW (foreach) step time per parameter
  tensor of small plain / sharded DTensor parameters (the per-tensor fixed cost; the per-element
  cost is bandwidth, priced from the profile).

The planner's :class:`~autoplan.search.pricing.costing.CostContext` picks the calibration for its world
size up automatically on the ``cpu`` profile (:func:`load_runtime`).
"""
from __future__ import annotations

import functools
import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from cost_models.calibrate import bench_collectives, fit_alpha_beta
from cost_models.collectives import collective_terms
from cost_models.errors import CalibrationError
from cost_models.hardware import load_hardware
from cost_models.hardware.host import cache_dir, host_key, save_host_profile
from cost_models.hardware.profile import Link
from hyper_parallel.local import RankPool

log = logging.getLogger(__name__)

_GEMM_SIZES = (128, 256, 512)
_STREAM_SIZES = (1 << 16, 1 << 18, 1 << 20)
_COLL_SIZES = tuple(2 ** k for k in (12, 14, 16, 18, 20, 22))   # 4 KiB .. 4 MiB


@dataclass(frozen=True)
class RuntimeOverheads:
    world: int
    op_s: float
    dtensor_op_s: float
    compute_scale: float
    collective_s: float
    link: Link
    sources: str = ""
    optimizer_tensor_s: float = 0.0
    optimizer_dtensor_tensor_s: float = 0.0
    memory_scale: float = 0.0       # 0: not measured (older calibrations); compute_scale is used

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(data: dict) -> "RuntimeOverheads":
        d = dict(data)
        d["link"] = Link(**d["link"])
        return RuntimeOverheads(**d)


def _path(world: int) -> Path:
    return cache_dir() / "hardware" / f"cpu-{host_key()}-runtime-w{int(world)}.json"


def save_runtime(rt: RuntimeOverheads) -> Path:
    path = _path(rt.world)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rt.to_dict(), indent=1))
    return path


def load_runtime(world: int) -> RuntimeOverheads | None:
    """The cached calibration of this host for ``world`` ranks, or None when there is none."""
    path = _path(world)
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    return _read(str(path), mtime)


@functools.lru_cache(maxsize=64)
def _read(path: str, mtime_ns: int) -> RuntimeOverheads | None:
    """Parsed once per (file, modification time): planners build many cost contexts."""
    try:
        return RuntimeOverheads.from_dict(json.loads(Path(path).read_text()))
    except (ValueError, TypeError, KeyError) as exc:
        log.warning("ignoring unreadable runtime calibration %s: %s", path, exc)
        return None


def _median(fn, reps: int, warmup: int = 3, barrier: bool = False) -> float:
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_runtime(reps: int = 20, layers: int = 16, width: int = 32) -> dict:
    """Rank function (every rank of the default group at once): the raw measurements."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict = {"rank": rank, "world": world}
    # per-kernel eager cost: `layers` x (linear, tanh): 2 forward kernels -> 6 planner kernels each
    torch.manual_seed(0)
    ws = [torch.randn(width, width, requires_grad=True) for _ in range(layers)]
    x = torch.randn(8, width, requires_grad=True)

    def chain(weights, inp):
        y = inp
        for w in weights:
            y = torch.tanh(torch.nn.functional.linear(y, w))
        y.sum().backward()

    kernels = 6 * layers
    dist.barrier()
    out["op_s"] = _median(lambda: chain(ws, x), reps) / kernels
    mesh = init_device_mesh("cpu", (world,))
    dws = [distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_() for w in ws]
    dx = distribute_tensor(x.detach(), mesh, [Replicate()]).requires_grad_()
    dist.barrier()
    out["dtensor_chain_s"] = _median(lambda: chain(dws, dx), reps) / kernels
    out["dtensor_op_s"] = max(out["dtensor_chain_s"] - out["op_s"], 0.0)
    # AdamW per parameter tensor, plain and sharded DTensor parameters
    def adamw(make):
        ps = [torch.nn.Parameter(make(torch.randn(width, width))) for _ in range(layers)]
        for q in ps:
            q.grad = make(torch.randn(width, width))
        opt = torch.optim.AdamW(ps, lr=1e-3)
        dist.barrier()
        return _median(opt.step, reps) / layers

    out["optimizer_tensor_s"] = adamw(lambda t: t)
    out["optimizer_dtensor_tensor_s"] = adamw(lambda t: distribute_tensor(t, mesh, [Shard(0)]))
    # GEMM throughput with all ranks computing at once
    for n in _GEMM_SIZES:
        a, b = torch.randn(n, n), torch.randn(n, n)
        dist.barrier()
        out[f"gemm{n}_s"] = _median(lambda: torch.mm(a, b), reps)
    # streaming ops with all ranks running at once: (seconds, bytes) per op and size
    stream = []
    for numel in _STREAM_SIZES:
        a, b = torch.randn(numel), torch.rand(numel) + 0.5
        for fn, nbytes in ((lambda: a + b, 12), (lambda: a * b, 12), (lambda: torch.nn.functional.silu(a), 8),
                           (lambda: torch.exp(a), 8), (lambda: torch.rsqrt(b), 8)):
            dist.barrier()
            stream.append((_median(fn, reps), nbytes * numel))
    out["stream"] = stream
    # DTensor collectives vs raw ones of the same full size
    n = 4096
    sh = distribute_tensor(torch.ones(world, n), mesh, [Shard(0)])
    raw_in, raw_out = torch.ones(n), torch.empty(world * n)
    out["raw_all_gather_s"] = _median(lambda: dist.all_gather_into_tensor(raw_out, raw_in), reps, barrier=True)
    out["dt_all_gather_s"] = _median(lambda: sh.redistribute(mesh, [Replicate()]).to_local(), reps, barrier=True)
    part = DTensor.from_local(torch.ones(world, n), mesh, [Partial()])
    raw = torch.ones(world, n)
    out["raw_all_reduce_s"] = _median(lambda: dist.all_reduce(raw), reps, barrier=True)
    out["dt_all_reduce_s"] = _median(lambda: part.redistribute(mesh, [Replicate()]).to_local(), reps, barrier=True)
    # the same all-reduce between bursts of eager compute (fwd + bwd of the small chain)
    bursts = 8
    big = DTensor.from_local(torch.ones(n), mesh, [Partial()])

    def burst_only():
        for _ in range(bursts):
            chain(ws, x)

    def burst_and_reduce():
        for _ in range(bursts):
            chain(ws, x)
            big.redistribute(mesh, [Replicate()]).to_local()

    out["burst_s"] = _median(burst_only, max(reps // 4, 3), warmup=1, barrier=True) / bursts
    out["burst_reduce_s"] = _median(burst_and_reduce, max(reps // 4, 3), warmup=1, barrier=True) / bursts
    out["interleaved_bytes"] = 4 * n
    return out


def _fit_link(frame) -> tuple[float, float]:
    """alpha/beta by least squares; when noise makes that fit unphysical, alpha from the smallest
    size and bandwidth from the largest (each with the ring step and byte counts)."""
    try:
        return fit_alpha_beta(frame)
    except CalibrationError as exc:
        log.info("runtime: %s; fitting alpha on the smallest and bandwidth on the largest size", exc)
    rows = frame.dropna(subset=["time_s"])
    terms = [collective_terms(k, b, n) for k, b, n in zip(rows["kind"], rows["nbytes"], rows["group_size"])]
    lo, hi = rows["nbytes"] == rows["nbytes"].min(), rows["nbytes"] == rows["nbytes"].max()
    alpha = statistics.median(t / tm.latency_steps for t, tm, m in zip(rows["time_s"], terms, lo) if m)
    inv = [max(t - alpha * tm.latency_steps, 0.0) / tm.wire_bytes for t, tm, m in zip(rows["time_s"], terms, hi) if m]
    return float(alpha), 1.0 / max(statistics.median(inv), 1e-12)


def calibrate_runtime(world: int = 4, pool=None, hardware=None, reps: int = 20, save: bool = True,
                      coll_reps: int = 8, rounds: int = 3) -> RuntimeOverheads:
    """Measure this host's eager-rank costs on ``world`` concurrent gloo ranks and cache them.

    Each quantity is the median over ranks and ``rounds`` passes (a shared host's load drifts).

    Also writes the fitted link into the cached ``cpu`` profile's links, so
    ``load_hardware("cpu")`` carries the latest calibration.
    """
    import pandas as pd

    hw = hardware or load_hardware("cpu")
    own = pool is None
    pool = pool or RankPool(world)
    try:
        rows = [r for _ in range(rounds) for r in pool.run(bench_runtime, reps)]
        coll = pool.run(bench_collectives, ["all_reduce", "all_gather", "reduce_scatter"], list(_COLL_SIZES),
                        coll_reps, 2, 2)[0]
    finally:
        if own:
            pool.close()
    mem_ratios = [t / (nb / (hw.memory_bandwidth * hw.efficiency.memory)) for r in rows for t, nb in r["stream"]]
    memory_scale = math.exp(statistics.median(math.log(max(x, 1e-9)) for x in mem_ratios))
    frame = pd.DataFrame([{k: v for k, v in r.items() if k != "stream"} for r in rows])
    med = frame.median(numeric_only=True)   # over ranks (measured at once) and rounds
    ratios = []
    for n in _GEMM_SIZES:
        ideal = 2.0 * n ** 3 / (hw.peak("fp32") * hw.efficiency.compute)
        ratios.append(max(float(med[f"gemm{n}_s"]) / ideal, 1e-9))
    scale = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    alpha, bw = _fit_link(pd.DataFrame(coll))
    link = Link(f"gloo_w{world}_calibrated", bandwidth=float(bw), latency=float(alpha))
    ab = collective_terms("all_reduce", float(med["interleaved_bytes"]), world).time(link)
    extra = max(float(med["burst_reduce_s"] - med["burst_s"]) - ab, 0.0)
    rt = RuntimeOverheads(
        world=int(world), op_s=float(med["op_s"]), dtensor_op_s=float(med["dtensor_op_s"]),
        compute_scale=float(scale), memory_scale=float(memory_scale), collective_s=extra, link=link,
        optimizer_tensor_s=float(med["optimizer_tensor_s"]),
        optimizer_dtensor_tensor_s=float(med["optimizer_dtensor_tensor_s"]),
        sources=f"measured on {world} concurrent gloo ranks ({host_key()}) at {time.strftime('%Y-%m-%d %H:%M:%S')}")
    if save:
        save_runtime(rt)
        if hw.device_type == "cpu" and hw.name == "cpu":
            save_host_profile(hw.with_overrides(intra_node=rt.link, inter_node=rt.link))
    log.info("runtime calibration: %s", rt)
    return rt


def main(argv: list[str] | None = None) -> int:
    """``python -m cost_models.runtime [--world 4]``: calibrate and print."""
    import argparse

    ap = argparse.ArgumentParser(prog="cost_models.runtime", description="calibrate eager-rank costs on gloo")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    rt = calibrate_runtime(args.world, reps=args.reps)
    print(json.dumps(rt.to_dict(), indent=1))
    print(f"saved: {_path(args.world)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
