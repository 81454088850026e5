"""Compute time of one op: roofline with shape-dependent efficiency, overridden by profiles.

roofline(op) = kernel overhead + max(FLOPs / (peak x efficiency(shape)), bytes / (bandwidth x efficiency))

GEMM efficiency falls with small M, N, K as prod(d / (d + dim_half)): tiles and cores go idle.
Fused attention kernels are priced at their own measured efficiency on the work they do (the
causal half under a causal mask; :func:`attention_time`), or like a GEMM over (s_q, s_k, head_dim)
on profiles without that measurement. Views cost a fixed view
overhead. Everything else is priced by the bytes it reads and writes. A per-category correction
fitted on profiled ops (:meth:`ComputeModel.fit`: fixed cost + scale of the roofline time)
corrects the roofline for ops that were not profiled, e.g. the same block at another batch or sequence length; a profile table entry for the
exact op wins over both.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import pandas as pd

from cost_models.hardware.profile import HardwareProfile
from cost_models.ops import OpSpec, TensorSpec
from cost_models.profile_table import ProfileTable
from cost_models.profiler import _resolve_op

log = logging.getLogger(__name__)

_GEMM = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
_ATTN_FWD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_flash_attention_forward", "_efficient_attention_forward", "npu_fusion_attention",
             "scaled_dot_product_attention"}
_REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "_log_softmax", "_softmax", "_safe_softmax",
           "_log_softmax_backward_data", "_softmax_backward_data", "nll_loss_forward", "nll_loss_backward",
           "norm", "var_mean", "embedding_dense_backward"}
_TRANSCENDENTAL = {"silu", "silu_backward", "gelu", "gelu_backward", "exp", "log", "rsqrt", "sqrt", "pow",
                   "tanh", "sigmoid", "sigmoid_backward", "tanh_backward", "erf", "sin", "cos"}
_COPY = {"clone", "copy_", "_to_copy", "cat", "stack", "select_backward", "slice_backward", "contiguous",
         "embedding", "index_select", "where", "tril", "triu", "fill_", "zero_", "ones", "zeros", "empty",
         "full", "ones_like", "zeros_like", "empty_like", "new_zeros", "new_empty", "scalar_tensor"}


_VIEW_LIKE = {"_unsafe_view", "_reshape_alias", "alias", "lift_fresh"}


def is_view(spec: OpSpec) -> bool:
    """True for ops that return an alias of an input (no data moves)."""
    if spec.short_name in _VIEW_LIKE:
        return True
    try:
        schema = _resolve_op(spec.op)._schema
    except Exception:  # noqa: BLE001 - unknown ops are priced as data-moving
        return False
    rets = schema.returns
    return bool(rets) and rets[0].alias_info is not None and not rets[0].alias_info.is_write


def category(spec: OpSpec) -> str:
    """gemm / attention / attention_bwd / reduction / transcendental / copy / strided / interleave /
    elementwise / view.

    ``strided``: an input whose innermost dim is not unit-stride (interleaved or broadcast), so the
    inner loop cannot use vector loads; ``interleave``: copies whose writes are strided (stack on
    the last dim, select_backward). Both run several times slower per byte than streaming ops.
    """
    name = spec.short_name
    if name in _GEMM:
        return "gemm"
    if name in _ATTN_FWD:
        return "attention"
    if name.endswith("_backward") and name[: -len("_backward")] in _ATTN_FWD:
        return "attention_bwd"
    if name in ("to", "type_as", "_to_copy"):
        # a no-op when the dtype does not change, else an elementwise conversion
        ts = spec.tensors
        if name == "type_as":
            target = ts[1].dtype if len(ts) > 1 else None
        else:
            target = next((v for v in spec.args[1:] + tuple(v for _, v in spec.kwargs) if _is_dtype_name(v)),
                          ts[0].dtype if ts else None)
        return "view" if ts and name != "_to_copy" and target == ts[0].dtype else "copy"
    if is_view(spec):
        return "view"
    if name in _REDUCE:
        return "reduction"
    if name in _TRANSCENDENTAL:
        return "transcendental"
    if _interleaves(spec):
        return "interleave"
    strided = any(_strided(t) for t in spec.tensors)
    if name in _COPY:
        return "strided" if strided else "copy"
    return "strided" if strided else "elementwise"


def _interleaves(spec: OpSpec) -> bool:
    """Copies whose *writes* are strided: stacking on the last dim, scattering a select back."""
    name = spec.short_name
    if name == "select_backward":
        return True
    if name == "stack":
        dims = [a for a in spec.args[1:] if isinstance(a, int)] + [v for k, v in spec.kwargs if k == "dim"]
        ts = spec.tensors
        return bool(ts) and bool(dims) and dims[0] in (-1, len(ts[0].shape))
    return False


def _is_dtype_name(v) -> bool:
    import torch

    return isinstance(v, str) and v.startswith("torch.") and isinstance(getattr(torch, v[6:], None), torch.dtype)


def _strided(t: TensorSpec) -> bool:
    """The innermost non-trivial dim is not unit-stride (interleaved or broadcast): no vector loads.

    Outer-dim gaps (a slice of a wider table, a transposed batch dim) keep contiguous inner runs
    and stream like contiguous tensors, so they do not count.
    """
    if t.stride is None:
        return False
    inner = [st for n, st in zip(t.shape, t.stride) if n > 1]
    return bool(inner) and inner[-1] != 1


def _storage_bytes(t: TensorSpec) -> int:
    """Bytes a strided tensor really spans (expanded dims with stride 0 read once)."""
    if t.stride is None or not t.shape:
        return t.nbytes
    if any(s == 0 for s in t.shape):
        return 0
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride) if st > 0)
    return min(span, t.numel) * t.itemsize


def gemm_dims(spec: OpSpec) -> tuple[int, int, int, int]:
    """(batch, M, N, K) of a matmul-family op."""
    ts = spec.tensors
    name = spec.short_name
    if name in ("addmm", "baddbmm"):
        ts = ts[1:3]
    a, b = ts[0].shape, ts[1].shape
    if name in ("bmm", "baddbmm"):
        return a[0], a[1], b[2], a[2]
    if name == "linear":
        m = math.prod(a[:-1])
        return 1, m, b[0], a[-1]
    return 1, a[-2], b[-1], a[-1]


def is_attention_op(short_name: str) -> bool:
    """A fused attention kernel (forward or its backward), by ATen short name."""
    return short_name in _ATTN_FWD or (short_name.endswith("_backward") and short_name[:-9] in _ATTN_FWD)


def gemm_shape_dims(short_name: str, shapes: list[tuple[int, ...]]) -> tuple[int, int, int] | None:
    """(M, N, K) of a matmul-family or fused-attention op from its input shapes; None for any
    other op. Batched dims fold into M (a bmm over heads runs as one wide GEMM); attention is
    (s_q, s_k, head_dim) like :func:`_attention_dims`."""
    if short_name in _ATTN_FWD or (short_name.endswith("_backward") and short_name[:-9] in _ATTN_FWD):
        q, k = shapes[0], shapes[1]
        return (q[-2], k[-2], q[-1]) if len(q) >= 2 and len(k) >= 2 else None
    if short_name not in _GEMM or len(shapes) < 2:
        return None
    if short_name in ("addmm", "baddbmm"):
        shapes = shapes[1:3]
    a, b = shapes[0], shapes[1]
    if len(a) < 2 or not b:
        return None
    if short_name == "linear":
        return math.prod(a[:-1]), b[0], a[-1]
    return math.prod(a[:-1]), b[-1], a[-1]


def _shape_curve(eff, m: float, n: float, k: float) -> float:
    return math.prod(d / (d + eff.dim_half) for d in (m, n, k))


def measured_efficiency(hardware: HardwareProfile, kind: str, m: float, n: float, k: float,
                        curve: Callable[[float, float, float], float]) -> float | None:
    """The achieved efficiency of a ``kind`` kernel at (m, n, k) from the device's measured points
    (``efficiency.kernels``, written by ``autoplan profile --kernels``): the nearest measured shape
    (in log distance over the three dimensions) at its measured efficiency, moved to (m, n, k) by
    ``curve``'s ratio between the two shapes -- a measurement anchors the curve where it was taken
    and the curve carries it to shapes nearby. None where the profile measured no such kernel."""
    pts = [p for p in hardware.efficiency.kernels if p[0] == kind]
    if not pts or min(m, n, k) <= 0:
        return None
    near = min(pts, key=lambda p: sum(abs(math.log(a / b)) for a, b in zip((m, n, k), p[1:4])))
    base = curve(*near[1:4])
    return min(1.0, near[4] * curve(m, n, k) / base) if base > 0 else near[4]


def gemm_efficiency(hardware: HardwareProfile, m: float, n: float, k: float) -> float:
    """Achieved fraction of dense peak for an (M, N, K) GEMM: the profile's large-GEMM efficiency
    (``efficiency.compute``, a published measurement) times prod(d / (d + dim_half)) -- small
    dimensions leave tiles and SMs idle. The one GEMM formula of the cost model; a device profile
    with measured GEMMs anchors it there (:func:`measured_efficiency`)."""
    eff = hardware.efficiency

    def curve(a, b, c):
        return eff.compute * _shape_curve(eff, a, b, c)
    got = measured_efficiency(hardware, "gemm", m, n, k, curve)
    return curve(m, n, k) if got is None else got


def grouped_gemm_efficiency(hardware: HardwareProfile, m: float, n: float, k: float) -> float:
    """Achieved fraction of peak for a grouped GEMM (the MoE experts' kernel) whose groups are
    (M, N, K) each: measured grouped GEMMs where the device profile has them, else one GEMM of
    that shape (:func:`gemm_efficiency` -- the datasheet profiles hold no grouped-kernel number)."""
    got = measured_efficiency(hardware, "grouped_gemm", m, n, k, lambda a, b, c: gemm_efficiency(hardware, a, b, c))
    return gemm_efficiency(hardware, m, n, k) if got is None else got


ATTENTION_HEAD_DIM = 128          # the head dim ``efficiency.attention`` is measured at
ATTENTION = "attention"            # gemm_split tag of a fused-attention op (full score matrix)
ATTENTION_CAUSAL = "attention_causal"   # ... of one under a causal mask (half the scores computed)


def causal_density(s_q: float, s_k: float, span: tuple = ()) -> float:
    """Fraction of the (s_q x s_k) score matrix a causal self-attention kernel computes when each
    query sees ``span`` (autoplan.capture.key_span): () every earlier key, S^2/2 of S^2;
    ("window", w) the last w keys, S*w - w^2/2 (the band: the first w rows a triangle, the rest w
    each); ("chunk", c) the earlier keys of its chunk, c^2/2 per full chunk. As for the plain
    causal half, the diagonal's S/2 is not counted. A span at least S long is the causal half;
    cross-attention (s_q != s_k) computes the whole matrix."""
    if s_q != s_k or s_q <= 0:
        return 1.0
    s = float(s_q)
    kind, n = (span[0], float(span[1])) if len(span) == 2 else ("", s)
    if n >= s or kind not in ("window", "chunk"):
        return 0.5
    if kind == "window":
        return (s * n - n * n / 2.0) / (s * s)
    full, rest = divmod(s, n)
    return (full * n * n / 2.0 + rest * rest / 2.0) / (s * s)


def keys_per_query(s: float, density: float) -> float:
    """The keys each query sees in a causal band that computes ``density`` of the (s x s) scores --
    :func:`causal_density`'s window inverted, w = s (1 - sqrt(1 - 2 d)); the causal half (or more): s."""
    return s * (1.0 - math.sqrt(max(0.0, 1.0 - 2.0 * density))) if density < 0.5 else s


def attention_time(hardware: HardwareProfile, peak: float, flops: float, s_q: float, s_k: float,
                   head_dim: float, causal: bool, density: float | None = None) -> float:
    """Seconds of a fused attention kernel whose full-score-matrix FLOPs are ``flops`` (torch's
    SDPA formula, which does not discount a causal mask). With a measured kernel efficiency
    (``efficiency.attention``, a flash-class kernel benchmark) the kernel does the causal half of
    the work under a causal mask (FlashAttention skips the masked tiles) at that efficiency,
    times the GEMM shape curve of the two sequence axes (short sequences leave SMs idle); without
    one it is a GEMM of shape (s_q, s_k, head_dim) over the whole matrix (K = head_dim runs at
    half efficiency on the curve -- what the profile would say of two batched GEMMs).
    ``density`` (:func:`causal_density`), where given, is the fraction of the matrix the kernel
    computes under its mask -- a sliding window's or a chunk's band -- in place of the causal half
    (self-attention as captured, s_q == s_k; a query shard of it is priced whole, as without one):
    a flash-class kernel skips the tiles outside the band (FlashAttention's ``window_size``), at
    the same measured efficiency (the profile holds no windowed-kernel measurement; see
    docs/attention_window.md); the unfused path computes the whole matrix whatever the mask.
    A device profile's measured attention (``efficiency.kernels`` points of kind "attention", keyed
    by sequence, keys each query sees and head dim) gives the efficiency on the work done instead,
    windowed kernels included (:func:`measured_efficiency`)."""
    eff = hardware.efficiency
    if density is None or s_q != s_k:   # queries split over ranks (split_tokens): the busiest rank's
        density = 0.5 if causal and s_q == s_k else 1.0   # rows see every key, as before
    span = keys_per_query(s_k, density)   # what the device's measured attention points are keyed by

    def curve(s, _span, d):
        return attention_efficiency(hardware, s, s, d)
    got = measured_efficiency(hardware, "attention", s_q, span, head_dim, curve) if s_q == s_k else None
    if got is not None:
        return flops * density / (peak * got)
    if eff.attention <= 0:
        return flops / (peak * gemm_efficiency(hardware, s_q, s_k, head_dim))
    return flops * density / (peak * attention_efficiency(hardware, s_q, s_k, head_dim))


def attention_efficiency(hardware: HardwareProfile, s_q: float, s_k: float, head_dim: float) -> float:
    """Fraction of peak a flash-class kernel reaches on the work it does: the profile's measured
    ``efficiency.attention`` (head dim 128, long sequences) times the shape curve of the two
    sequence axes and a head-dim factor below 128."""
    eff = hardware.efficiency
    shape = (s_q / (s_q + eff.dim_half)) * (s_k / (s_k + eff.dim_half))
    # ``attention`` is measured at head dim 128; a narrower head does less work per tile load
    # (FlashAttention-3 Fig. 5: causal forward at head dim 64 ~77 % of head dim 128's speed; the
    # curve's d / (d + dim_half) ratio gives 67 %); wider heads are not credited above it
    width = min(1.0, (head_dim / (head_dim + eff.dim_half)) / (ATTENTION_HEAD_DIM / (ATTENTION_HEAD_DIM + eff.dim_half)))
    return eff.attention * shape * width


def gemm_split(m: int, n: int, k: int, has_weight: bool) -> str:
    """The dimension of an (M, N, K) GEMM that a tensor-parallel shard divides: "" for GEMMs
    between activations (attention scores and context, fused attention: heads are their batch,
    so a head shard leaves each head's GEMM whole); for a weight GEMM the larger of N and K
    ("n" on ties) -- column-parallel projections cut their output features N (q, up/gate, the
    vocabulary head: N >= K), row-parallel ones their input features K (o, down: K >= N).
    Grouped-query k/v projections (N < K, column-parallel) are the exception: priced at K/t,
    slightly faster than their N/t."""
    if not has_weight:
        return ""
    return "n" if n >= k else "k"


def sharded_gemm_dims(m: float, n: float, k: float, split: str, shard: int) -> tuple[float, float, float]:
    """The (M, N, K) one rank runs when a tensor-parallel shard of degree ``shard`` divides the
    ``split`` dimension (:func:`gemm_split`; "" or shard 1: unchanged)."""
    if shard <= 1 or not split or split.startswith(ATTENTION):
        return m, n, k
    if split == "n":
        return m, n / shard, k
    if split == "k":
        return m, n, k / shard
    raise ValueError(f"sharded_gemm_dims: split={split!r} is not one of '', 'n', 'k'")


def _attention_dims(spec: OpSpec) -> tuple[int, int, int, int, bool]:
    q, k = spec.tensors[0].shape, spec.tensors[1].shape
    causal = False
    for v in spec.args[3:] + tuple(v for _, v in spec.kwargs if _ == "is_causal"):
        if isinstance(v, bool):
            causal = v
            break
    return q[0] * q[1], q[2], k[2], q[3], causal


def op_flops(spec: OpSpec) -> float:
    """Floating-point operations of one call (multiply-add = 2)."""
    cat = category(spec)
    if cat == "gemm":
        bsz, m, n, k = gemm_dims(spec)
        return 2.0 * bsz * m * n * k
    if cat in ("attention", "attention_bwd"):
        bh, sq, sk, d, causal = _attention_dims(spec)
        fwd = 4.0 * bh * sq * sk * d * (0.5 if causal else 1.0)
        return fwd if cat == "attention" else 2.5 * fwd
    return float(sum(t.numel for t in spec.out) or max((t.numel for t in spec.tensors), default=0))


def op_bytes(spec: OpSpec) -> float:
    """Bytes read and written (inputs as strided, outputs dense)."""
    if category(spec) == "view":
        return 0.0
    return float(sum(_storage_bytes(t) for t in spec.tensors) + sum(t.nbytes for t in spec.out))


def _dtype(spec: OpSpec) -> str:
    ts = spec.tensors
    return ts[0].dtype if ts else "torch.float32"


@dataclass
class ComputeModel:
    """Prices op specs on one hardware profile, with optional profile table and fitted scales."""

    hardware: HardwareProfile
    table: ProfileTable | None = None
    corrections: dict[str, tuple[float, float]] = field(default_factory=dict)  # category -> (fixed s, scale)

    def roofline(self, spec: OpSpec) -> float:
        """Seconds from the roofline (before any fitted scale), overhead included."""
        eff = self.hardware.efficiency
        cat = category(spec)
        if cat == "view":
            return eff.view_overhead
        nbytes = op_bytes(spec)
        t_mem = nbytes / eff.bandwidth(self.hardware.memory_bandwidth, nbytes)
        t_flop = 0.0
        if cat == "gemm":
            _, m, n, k = gemm_dims(spec)
            t_flop = op_flops(spec) / (self.hardware.peak(_dtype(spec)) * gemm_efficiency(self.hardware, m, n, k))
        elif cat in ("attention", "attention_bwd"):
            bh, sq, sk, d, causal = _attention_dims(spec)
            full = 4.0 * bh * sq * sk * d * (1.0 if cat == "attention" else 2.5)
            t_flop = attention_time(self.hardware, self.hardware.peak(_dtype(spec)), full, sq, sk, d, causal)
        return eff.kernel_overhead + max(t_flop, t_mem)

    def estimate(self, spec: OpSpec) -> float:
        """Roofline with the fitted correction of the op's category (no table lookup)."""
        cat = category(spec)
        if cat not in self.corrections:
            return self.roofline(spec)
        fixed, scale = self.corrections[cat]
        return fixed + scale * self._body(spec)

    def _body(self, spec: OpSpec) -> float:
        eff = self.hardware.efficiency
        return self.roofline(spec) - (eff.view_overhead if category(spec) == "view" else eff.kernel_overhead)

    def time(self, spec: OpSpec) -> float:
        """Seconds for one call: the profiled time when the table has this op, else :meth:`estimate`."""
        if self.table is not None:
            got = self.table.lookup(spec)
            if got is not None:
                return got
        return self.estimate(spec)

    def step_time(self, specs: Iterable[OpSpec]) -> float:
        """Sum over specs of count x time."""
        return sum(s.count * self.time(s) for s in specs)

    def frame(self, specs: Iterable[OpSpec]) -> pd.DataFrame:
        """Per-spec table: key, category, count, flops, bytes, roofline_s, estimate_s, time_s, source."""
        rows = []
        for s in specs:
            prof = self.table.lookup(s) if self.table is not None else None
            est = self.estimate(s)
            rows.append({"key": s.key, "phase": s.phase, "category": category(s), "count": s.count,
                         "flops": op_flops(s), "bytes": op_bytes(s), "roofline_s": self.roofline(s),
                         "estimate_s": est, "time_s": prof if prof is not None else est,
                         "source": "profile" if prof is not None else "roofline"})
        return pd.DataFrame(rows)

    def fit(self, specs: Iterable[OpSpec], measured_s: Iterable[float]) -> dict[str, tuple[float, float]]:
        """Per-category correction ``time = fixed + scale x roofline body``, fitted on profiled ops.

        Weighted least squares on relative error, so a 5 us op counts as much as a 50 ms one.
        One op (or one size) in a category fits the scale only, with the hardware's kernel
        overhead as the fixed cost. Fitting on one shape and predicting another is how profiling
        corrects the roofline for ops it never saw. Returns (and stores) the corrections.
        """
        import numpy as np

        groups: dict[str, list[tuple[float, float]]] = {}
        for s, t in zip(specs, measured_s):
            if t is None or not math.isfinite(t) or t <= 0:
                continue
            groups.setdefault(category(s), []).append((self._body(s), float(t)))
        out = {}
        for cat, pts in groups.items():
            x = np.array([p[0] for p in pts])
            t = np.array([p[1] for p in pts])
            fixed0 = self.hardware.efficiency.view_overhead if cat == "view" else self.hardware.efficiency.kernel_overhead
            if cat != "view" and len(set(np.round(np.log(np.maximum(x, 1e-12)), 1))) >= 2:
                a = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
                (fixed, scale), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
                if fixed < 0 or scale <= 0:
                    fixed = 0.0 if fixed < 0 else fixed
                    scale = float(np.exp(np.mean(np.log(np.maximum(t - fixed, 1e-12) / np.maximum(x, 1e-12)))))
            else:
                fixed = float(np.exp(np.mean(np.log(t)))) if cat == "view" else fixed0
                resid = np.maximum(t - fixed, 1e-12)
                scale = float(np.exp(np.mean(np.log(resid / np.maximum(x, 1e-12))))) if cat != "view" else 0.0
            out[cat] = (float(fixed), float(scale))
        self.corrections = out
        return out
