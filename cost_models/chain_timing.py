"""Elementwise chains timed on this host, eager and compiled, so the measured profile knows what fusion buys here.

A datasheet profile prices a fused chain by its bytes (cost_models.fusion); on the host the cost of
a step of small tensors is mostly fixed per-kernel work, which differs between the two forms: an
eager op pays dispatch and an autograd node, a kernel of a compiled region neither. This replays
each distinct chain of a captured graph on real tensors -- its ATen ops in graph order, its external
inputs random -- forward and backward, once op by op and once through ``torch.compile``, and fits
what one compiled kernel costs beyond its bytes (:func:`fused_kernel_overhead`), the number the
``cpu`` profile stores (``Efficiency.fused_kernel_overhead``).
"""
from __future__ import annotations

import logging
import operator
import statistics
from dataclasses import replace

from cost_models.errors import CalibrationError
from cost_models.fusion import Fusion, chain_outputs
from cost_models.hardware.profile import HardwareProfile
from cost_models.profiler import TimingConfig, _resolve_op, time_callable

log = logging.getLogger(__name__)


def _arg(value, env: dict, producers: list[str], torch):
    """An IR argument as a real one: ``{"tensor": i}`` the i-th input's tensor, dtype names dtypes."""
    if isinstance(value, dict):
        if set(value) == {"tensor"}:
            return env[producers[value["tensor"]]]
        if set(value) == {"dtype"}:
            return getattr(torch, str(value["dtype"]).split(".")[-1])
        if set(value) == {"device"}:
            return None
        raise CalibrationError(f"chain replay: an argument it cannot rebuild: {value!r}")
    if isinstance(value, list):
        return [_arg(v, env, producers, torch) for v in value]
    return value


def chain_program(chain: tuple[str, ...], by_name: dict):
    """(run, inputs): ``run(*tensors)`` replays ``chain``'s ops and returns the tensors that leave
    it; ``inputs`` the metas of its external inputs, in the order ``run`` takes them."""
    import torch

    members = set(chain)
    inputs: dict[str, object] = {}
    for x in chain:
        n = by_name[x]
        for p, m in zip(n.input_nodes, n.inputs):
            if p not in members:
                inputs.setdefault(p, m)
    names = list(inputs)
    leaving = chain_outputs(chain, by_name)

    def run(*tensors):
        env = dict(zip(names, tensors))
        for x in chain:
            n = by_name[x]
            args = [_arg(a, env, n.input_nodes, torch) for a in n.args]
            kwargs = {k: _arg(v, env, n.input_nodes, torch) for k, v in (n.kwargs or {}).items()}
            op = operator.getitem if n.op == "getitem" else _resolve_op(n.op if n.op.count(".") == 2 else f"{n.op}.default")
            env[x] = op(*args, **kwargs)
        return tuple(env[x] for x in leaving)

    return run, [inputs[p] for p in names]


def _tensor(meta, torch, grad: bool):
    dtype = getattr(torch, meta.dtype.split(".")[-1])
    if dtype.is_floating_point:
        return torch.randn(tuple(meta.shape), dtype=dtype).requires_grad_(grad)
    return torch.zeros(tuple(meta.shape), dtype=dtype)


def time_chains(nodes, fusion: Fusion, cfg: TimingConfig = TimingConfig(), limit: int | None = None):
    """One row per distinct chain of ``fusion`` (same ops on the same shapes timed once): its ops,
    eager and fused forward bytes and kernels (three per kernel: forward and two backward), and
    forward + backward seconds eager and compiled. pandas DataFrame."""
    import pandas as pd
    import torch

    by_name = {n.name: n for n in nodes}
    rows, seen = [], set()
    for chain in fusion.chains:
        ops = tuple(by_name[x].op for x in chain)
        key = (ops, tuple(tuple(m.shape) for x in chain for m in by_name[x].inputs))
        if key in seen:
            continue
        seen.add(key)
        run, metas = chain_program(chain, by_name)
        ins = [_tensor(m, torch, True) for m in metas]
        outs = run(*ins)
        if not any(o.requires_grad for o in outs):
            continue   # nothing to differentiate: not a chain of the training step
        grads = [torch.randn_like(o) if o.requires_grad else None for o in outs]
        compiled = torch.compile(run, dynamic=False)

        def step(fn):
            got = fn(*ins)
            torch.autograd.backward([o for o in got if o.requires_grad], [g for g in grads if g is not None])
        moved = [x for x in chain if x in fusion.bytes]
        row = {"ops": " ".join(o.split(".")[1] for o in ops if o != "getitem"),
               "eager_bytes": fusion.eager_bytes([by_name[x] for x in moved]),
               "fused_bytes": float(sum(fusion.bytes[x] for x in moved)),
               "eager_kernels": 3 * sum(1 for x in moved if by_name[x].bytes_read or by_name[x].bytes_written),
               "fused_kernels": 3}
        try:
            row["eager_s"] = time_callable(lambda: step(run), "cpu", cfg)[0]
            row["compiled_s"] = time_callable(lambda: step(compiled), "cpu", cfg)[0]
        except Exception as exc:  # noqa: BLE001 - a chain torch cannot compile here is reported, not fatal
            log.warning("chain %s: %s", row["ops"][:80], exc)
            row["error"] = str(exc)[:200]
        rows.append(row)
        if limit and len(rows) >= limit:
            break
    return pd.DataFrame(rows)


def fused_kernel_overhead(frame, hardware: HardwareProfile) -> float:
    """Seconds one compiled kernel costs beyond moving its bytes at the profile's bandwidth: the
    median over the timed chains of (compiled time - fused bytes x 3 / bandwidth) / kernels. It
    includes entering the compiled region (guards, the autograd wrapper), which a block compiled
    whole pays once for all its chains: an upper bound for a kernel inside a block."""
    ok = frame.dropna(subset=["compiled_s"]) if "compiled_s" in frame else frame.iloc[0:0]
    if ok.empty:
        raise CalibrationError("fused_kernel_overhead: no chain was timed compiled")
    per = []
    for r in ok.itertuples():
        moved = 3.0 * r.fused_bytes / hardware.efficiency.bandwidth(hardware.memory_bandwidth, r.fused_bytes)
        per.append(max(r.compiled_s - moved, 0.0) / r.fused_kernels)
    return float(statistics.median(per))


def profile_chains(nodes, fusion: Fusion, hardware: HardwareProfile,
                   cfg: TimingConfig = TimingConfig(warmup=5, min_reps=5, max_reps=30, budget_s=0.05,
                                                    statistic="min")):
    """(rows of :func:`time_chains`, ``hardware`` with the fitted ``fused_kernel_overhead``): what
    ``autoplan profile`` stores in the host's profile. The minimum over repetitions: on a shared host
    contention only adds time, and a compiled call's first repetitions still settle its caches."""
    frame = time_chains(nodes, fusion, cfg)
    eff = replace(hardware.efficiency, fused_kernel_overhead=fused_kernel_overhead(frame, hardware))
    return frame, hardware.with_overrides(efficiency=eff)
