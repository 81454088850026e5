"""Hardware profiles: datasheet numbers of one accelerator kind, loaded from JSON files in this folder.

A profile is data, not code: peak FLOP/s per dtype, HBM bandwidth and capacity, devices per node,
the two link levels (inside a node, between nodes) and the efficiency factors that turn datasheet
peaks into achievable rates. Which profiles exist and how one is loaded by name (the JSON files,
and ``cpu``, measured on the current host) is :mod:`cost_models.hardware.catalog`.
"""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cost_models.errors import UnknownHardwareError

log = logging.getLogger(__name__)

_DTYPE_ALIASES = {
    "torch.bfloat16": "bf16", "bfloat16": "bf16", "torch.float16": "fp16", "float16": "fp16",
    "half": "fp16", "torch.float32": "fp32", "float32": "fp32", "float": "fp32",
    "torch.float64": "fp64", "float64": "fp64",
}


def dtype_key(dtype: Any) -> str:
    """'bf16' / 'fp16' / 'fp32' ... for a torch dtype or a string."""
    text = str(dtype)
    return _DTYPE_ALIASES.get(text, text)


@dataclass(frozen=True)
class Link:
    """One level of interconnect: per-direction bandwidth in bytes/s, latency (alpha) in seconds.

    ``busbw``: where a public measurement exists, the achieved ring bus bandwidth by message size,
    ((message bytes, bytes/s), ...) ascending (nccl-tests' busbw of an all-reduce over the
    level). Mid-size messages run far below the asymptote (A100 NVLink: 133 GB/s at 33 MB, 232 at
    8 GB), which alpha-beta with a datasheet latency does not reproduce; ring collectives on a
    link that has one are priced from it (:func:`cost_models.collectives.bus_bandwidth`).
    """

    name: str
    bandwidth: float
    latency: float
    busbw: tuple = ()

    def __post_init__(self) -> None:
        if self.bandwidth <= 0:
            raise ValueError(f"Link {self.name!r}: bandwidth must be > 0, got {self.bandwidth}")
        if self.latency < 0:
            raise ValueError(f"Link {self.name!r}: latency must be >= 0, got {self.latency}")
        pts = tuple((float(b), float(w)) for b, w in self.busbw)
        if any(b <= 0 or w <= 0 for b, w in pts) or any(a[0] >= b[0] for a, b in zip(pts, pts[1:])):
            raise ValueError(f"Link {self.name!r}: busbw={self.busbw!r} must be (bytes > 0, bytes/s > 0) pairs "
                             "with strictly ascending sizes")
        object.__setattr__(self, "busbw", pts)


KERNEL_KINDS = ("gemm", "grouped_gemm", "attention")


@dataclass(frozen=True)
class Efficiency:
    """Fractions of datasheet peak that real kernels reach, and fixed per-kernel costs.

    ``dim_half`` is the GEMM dimension at which a GEMM reaches half of ``compute`` efficiency on
    that axis: small M/N/K leave tiles and cores idle, which is what makes efficiency shape-dependent.
    """

    compute: float = 0.7
    memory: float = 0.8
    dim_half: float = 128.0
    kernel_overhead: float = 5e-6
    view_overhead: float = 1e-6
    link: float = 0.8
    cache_bytes: float = 0.0        # working set (read + written) below which ``cache_bandwidth`` applies
    cache_bandwidth: float = 0.0    # 0: no cache term (datasheet profiles)
    cache_sharpness: float = 3.0    # how abruptly speed falls as the working set outgrows the cache
    # fused (flash-class) attention, forward + backward, as a fraction of peak on the work it
    # does (the causal half of the scores for a causal mask) at long sequences, head dim 128: a
    # kernel benchmark's number (the profile's sources say which). 0: none measured -- fused
    # attention is then priced as a GEMM of shape (s_q, s_k, head_dim) on the full score matrix
    attention: float = 0.0
    # kernels measured on the device (``autoplan profile --kernels``): (kind, m, n, k, efficiency)
    # points that anchor the shape curves above where they were measured -- kind "gemm" (M, N, K),
    # "grouped_gemm" (M = rows per group, N, K) or "attention" (M = sequence, N = the keys each
    # query sees: the sequence, or a sliding window, K = head dim; efficiency on the work done).
    # Empty: the datasheet curves alone (cost_models.compute.measured_efficiency)
    kernels: tuple = ()
    # seconds one kernel of a compiled chain (cost_models.fusion) costs on this device beyond its
    # bytes, where it differs from an eager op's: measured by ``autoplan profile`` on the host
    # (cost_models.chain_timing). 0: not measured -- a fused kernel costs what an eager one does
    fused_kernel_overhead: float = 0.0

    def __post_init__(self) -> None:
        pts = []
        for p in self.kernels:
            try:
                kind, m, n, k, e = p
                pt = (str(kind), float(m), float(n), float(k), float(e))
            except (TypeError, ValueError):
                raise ValueError(f"Efficiency.kernels: {p!r} is not a (kind, m, n, k, efficiency) point") from None
            if pt[0] not in KERNEL_KINDS or min(pt[1:4]) <= 0 or not 0 < pt[4] <= 1:
                raise ValueError(f"Efficiency.kernels: {p!r} needs kind in {KERNEL_KINDS}, m, n, k > 0 and "
                                 "0 < efficiency <= 1")
            pts.append(pt)
        object.__setattr__(self, "kernels", tuple(pts))

    def bandwidth(self, dram: float, nbytes: float) -> float:
        """Achievable bytes/s for a working set of ``nbytes``: cache speed for small sets, blending
        smoothly into DRAM speed (times ``memory``) as the set outgrows the cache."""
        big = dram * self.memory
        if self.cache_bytes <= 0 or self.cache_bandwidth <= big:
            return big
        return big + (self.cache_bandwidth - big) / (1.0 + (nbytes / self.cache_bytes) ** self.cache_sharpness)


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    vendor: str
    device_type: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_capacity: int
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    efficiency: Efficiency = field(default_factory=Efficiency)
    sources: tuple[str, ...] = ()
    notes: str = ""
    # memory the planner may not fill: a fixed reserve (CUDA/CANN context, NCCL/HCCL buffers,
    # GEMM workspaces) and a fraction lost to caching-allocator fragmentation
    memory_reserved: int = 0
    memory_fragmentation: float = 0.0

    def usable_memory(self) -> float:
        """Bytes per device a plan may use: capacity x (1 - fragmentation) - reserved."""
        return self.memory_capacity * (1.0 - self.memory_fragmentation) - self.memory_reserved

    def peak(self, dtype: Any) -> float:
        """Dense peak FLOP/s for ``dtype``; falls back to fp32 for dtypes the sheet does not list."""
        key = dtype_key(dtype)
        if key in self.peak_flops:
            return self.peak_flops[key]
        if "fp32" in self.peak_flops:
            return self.peak_flops["fp32"]
        raise UnknownHardwareError(f"{self.name}: no peak FLOP/s for dtype {key!r} and no fp32 fallback")

    def link(self, inter_node: bool) -> Link:
        return self.inter_node if inter_node else self.intra_node

    def with_overrides(self, **changes: Any) -> "HardwareProfile":
        """A copy with fields replaced (e.g. calibrated links, devices_per_node of a supernode)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["sources"] = list(self.sources)
        out["efficiency"]["kernels"] = [list(p) for p in self.efficiency.kernels]
        return out

    @staticmethod
    def from_dict(data: dict) -> "HardwareProfile":
        try:
            return HardwareProfile(
                name=data["name"], vendor=data["vendor"], device_type=data["device_type"],
                peak_flops={dtype_key(k): float(v) for k, v in data["peak_flops"].items()},
                memory_bandwidth=float(data["memory_bandwidth"]),
                memory_capacity=int(data["memory_capacity"]),
                devices_per_node=int(data["devices_per_node"]),
                intra_node=Link(**data["intra_node"]), inter_node=Link(**data["inter_node"]),
                efficiency=Efficiency(**data.get("efficiency", {})),
                sources=tuple(data.get("sources", ())), notes=data.get("notes", ""),
                memory_reserved=int(data.get("memory_reserved", 0)),
                memory_fragmentation=float(data.get("memory_fragmentation", 0.0)),
            )
        except (KeyError, TypeError) as exc:
            raise UnknownHardwareError(f"hardware data {data.get('name', '?')!r} is malformed: {exc!r}") from exc

