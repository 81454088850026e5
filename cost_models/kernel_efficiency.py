"""Measure the kernels the cost model prices, at the shapes it prices them, on the device at hand.

The datasheet profiles price a GEMM by one published large-GEMM efficiency and a shape curve, the
MoE experts' grouped GEMM as one GEMM of an expert's shape, and fused attention by one published
kernel efficiency with a sequence and head-dim curve. Those are the terms a published run can
disagree with and no published table settles (grouped GEMMs at an expert's shape, attention at head
dim 64 or in a sliding window). This module times each kernel forward + backward on the device --
the GEMM as ``x @ w``, the grouped GEMM as ``hyper_parallel``'s ``grouped_mm`` (what our runtime
runs; ``torch._grouped_mm`` where it applies), attention as torch's SDPA under a causal mask
(``flex_attention`` with a band mask for a sliding window) -- and sets the achieved efficiency
beside the profile's prediction. :func:`with_measured` writes the measurements into a profile
(``Efficiency.kernels``), where :func:`cost_models.compute.measured_efficiency` anchors the curves
on them.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import pandas as pd
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils import flop_counter

from cost_models.compute import attention_time, causal_density, gemm_efficiency, grouped_gemm_efficiency
from cost_models.errors import CalibrationError
from cost_models.hardware.profile import HardwareProfile
from cost_models.profiler import TimingConfig, time_callable
from hyper_parallel.core.expert_parallel.grouped import grouped_mm

log = logging.getLogger(__name__)

KINDS = ("gemm", "grouped_gemm", "attention")
GEMM_PASSES = 3.0   # forward + backward over forward FLOPs: a GEMM's backward is two GEMMs of its size


@dataclass(frozen=True)
class KernelShape:
    """One kernel as the cost model prices it.

    - ``gemm``: [m, k] @ [k, n];
    - ``grouped_gemm``: ``groups`` GEMMs of [m, k] @ [k, n] in one call (m rows per expert);
    - ``attention``: ``groups`` heads of (m queries, n keys, k head dim), causal, each query seeing
      the last ``window`` keys (0: every earlier key).
    ``note`` says where the shape comes from (which model, which layout)."""

    kind: str
    m: int
    n: int
    k: int
    groups: int = 1
    window: int = 0
    note: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KernelShape(kind={self.kind!r}): not one of {KINDS}")
        if min(self.m, self.n, self.k, self.groups) <= 0 or self.window < 0:
            raise ValueError(f"KernelShape{(self.m, self.n, self.k, self.groups, self.window)}: m, n, k, groups "
                             "must be > 0 and window >= 0")
        if self.kind == "attention" and self.m != self.n:
            raise ValueError(f"KernelShape(kind='attention', m={self.m}, n={self.n}): self-attention only (m == n)")

    @property
    def span(self) -> int:
        """The keys a query sees (attention): the window, or the whole sequence."""
        return self.window if 0 < self.window < self.n else self.n

    def density(self) -> float:
        """Fraction of the score matrix the kernel computes (attention; 1 for a GEMM)."""
        if self.kind != "attention":
            return 1.0
        return causal_density(self.m, self.n, ("window", self.window) if self.window else ())

    def full_flops(self) -> float:
        """Forward + backward FLOPs the cost model counts before any mask: 2 m n k per GEMM (per
        group); for attention what torch's FLOP counter gives SDPA -- the capture's count, so a
        captured op's FLOPs over one head's are its heads."""
        if self.kind == "attention":
            q = (1, self.groups, self.m, self.k)
            kv = (1, self.groups, self.n, self.k)
            return float(flop_counter.sdpa_flop_count(q, kv, kv) + flop_counter.sdpa_backward_flop_count(q, q, kv, kv))
        return GEMM_PASSES * 2.0 * self.m * self.n * self.k * self.groups

    def flops(self) -> float:
        """The FLOPs the kernel does: a causal or windowed attention skips the masked scores."""
        return self.full_flops() * self.density()


def predicted_seconds(hw: HardwareProfile, shape: KernelShape, dtype: str = "bf16", dtype_bytes: int = 2) -> float:
    """What the cost model charges for ``shape`` forward + backward on ``hw``: the formulas
    :mod:`cost_models.compute` prices GEMMs and attention with, and the grouped GEMM's roofline
    against its weights' bytes as ``autoplan.search.experts.search.grouped_expert_time`` has it."""
    peak = hw.peak(dtype)
    if shape.kind == "attention":
        return attention_time(hw, peak, shape.full_flops(), shape.m, shape.n, shape.k, True, shape.density())
    if shape.kind == "gemm":
        return shape.flops() / (peak * gemm_efficiency(hw, shape.m, shape.n, shape.k))
    weights = GEMM_PASSES * shape.groups * shape.n * shape.k * dtype_bytes
    return max(shape.flops() / (peak * grouped_gemm_efficiency(hw, shape.m, shape.n, shape.k)),
               weights / (hw.memory_bandwidth * hw.efficiency.memory))


def kernel_fn(shape: KernelShape, device="cpu", dtype=None) -> Callable[[], object]:
    """A callable running ``shape`` forward + backward once on fresh-per-call autograd graphs
    (inputs built once; gradients returned, not accumulated)."""
    dtype = dtype or torch.bfloat16

    def rand(*size):   # values only need to be ordinary numbers: filled where they live, in their dtype
        return torch.empty(*size, device=device, dtype=dtype).uniform_(-0.02, 0.02).requires_grad_(True)

    if shape.kind == "gemm":
        x, w = rand(shape.m, shape.k), rand(shape.k, shape.n)

        def run():
            y = x @ w
            return torch.autograd.grad(y, (x, w), torch.ones_like(y))
        return run
    if shape.kind == "grouped_gemm":
        x, w = rand(shape.m * shape.groups, shape.k), rand(shape.groups, shape.k, shape.n)
        counts = [shape.m] * shape.groups

        def run():
            y = grouped_mm(x, w, counts)
            return torch.autograd.grad(y, (x, w), torch.ones_like(y))
        return run
    q, k, v = (rand(1, shape.groups, shape.m, shape.k) for _ in range(3))
    if shape.window and shape.window < shape.n:
        w = shape.window

        def band(b, h, qi, ki):
            return (ki <= qi) & (qi - ki < w)
        mask = create_block_mask(band, None, None, shape.m, shape.n, device=str(device))
        attend = torch.compile(flex_attention) if torch.device(device).type == "cuda" else flex_attention

        def run():
            y = attend(q, k, v, block_mask=mask)
            return torch.autograd.grad(y, (q, k, v), torch.ones_like(y))
        return run

    def run():
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.autograd.grad(y, (q, k, v), torch.ones_like(y))
    return run


def measure(shapes: Iterable[KernelShape], hw: HardwareProfile, device="cpu", dtype=None,
            cfg: TimingConfig = TimingConfig(warmup=2, min_reps=3, max_reps=20, budget_s=0.5),
            progress: Callable[[KernelShape], None] | None = None) -> pd.DataFrame:
    """One row per shape: measured seconds (forward + backward, median), the cost model's
    prediction on ``hw``, both as efficiencies (FLOPs done / (seconds x peak)), and their ratio.
    A shape whose kernel fails on this device keeps its row with ``error`` set."""
    dtype = dtype or torch.bfloat16
    dkey = str(dtype).replace("torch.", "")
    peak = hw.peak(dkey)
    rows = []
    for s in shapes:
        row = {**dataclasses.asdict(s), "span": s.span if s.kind == "attention" else 0, "flops": s.flops(),
               "predicted_s": predicted_seconds(hw, s, dkey, torch.empty((), dtype=dtype).element_size()),
               "error": ""}
        try:
            t, reps, spread = time_callable(kernel_fn(s, device, dtype), device, cfg)
            row.update(measured_s=t, reps=reps, spread=spread)
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
            log.warning("kernel %s %s failed on %s: %s", s.kind, (s.m, s.n, s.k, s.groups), device, exc)
            row.update(measured_s=math.nan, reps=0, spread=math.nan, error=str(exc).splitlines()[0][:200])
        rows.append(row)
        if progress:
            progress(s)
    out = pd.DataFrame(rows)
    out["predicted_eff"] = out["flops"] / (out["predicted_s"] * peak)
    out["measured_eff"] = out["flops"] / (out["measured_s"] * peak)
    out["measured_over_predicted"] = out["measured_s"] / out["predicted_s"]
    return out


def with_measured(hw: HardwareProfile, frame: pd.DataFrame, source: str) -> HardwareProfile:
    """``hw`` with the measured efficiencies of ``frame`` (:func:`measure`) as its kernel points
    (a point measured again replaces the old one) and ``source`` added to its sources. Rows that
    failed, or whose efficiency is not in (0, 1], are left out."""
    if frame.empty:
        raise CalibrationError("with_measured(frame=...): no measured kernels")
    new = {}
    for r in frame.itertuples():
        eff = float(r.measured_eff)
        if r.error or not 0 < eff <= 1:
            continue
        n = r.span if r.kind == "attention" else r.n
        new[(r.kind, float(r.m), float(n), float(r.k))] = eff
    if not new:
        raise CalibrationError(f"with_measured: none of the {len(frame)} rows measured an efficiency in (0, 1]")
    kept = [p for p in hw.efficiency.kernels if tuple(p[:4]) not in new]
    points = tuple(kept) + tuple((*key, e) for key, e in new.items())
    eff = dataclasses.replace(hw.efficiency, kernels=points)
    return hw.with_overrides(efficiency=eff, sources=tuple(hw.sources) + (source,))
