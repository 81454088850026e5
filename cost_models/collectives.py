"""Alpha-beta cost of collectives, per mesh dimension.

Time of one collective = latency steps * alpha + bytes on the busiest link / beta-bandwidth.
Ring algorithms (NCCL's and gloo's default for large messages) follow the textbook counts in
shared/reference/formulas.md; tree variants trade bandwidth-optimal rings for log(n) latency.
``nbytes`` is always the *full* logical size: the all-reduced buffer, or the gathered (all-gather)
/ pre-scatter (reduce-scatter) tensor, or the whole all-to-all buffer of one rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from cost_models.hardware.profile import Link

Kind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast"]
Algorithm = Literal["ring", "tree"]
KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


@dataclass(frozen=True)
class CollectiveTerms:
    """A collective's cost as coefficients: time = latency_steps * alpha + wire_bytes / bandwidth."""

    latency_steps: float
    wire_bytes: float

    def time(self, link: Link, link_efficiency: float = 1.0) -> float:
        return self.latency_steps * link.latency + self.wire_bytes / (link.bandwidth * link_efficiency)


def _check(kind: str, nbytes: float, group_size: int, algorithm: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"collective kind={kind!r} is not one of {KINDS}")
    if algorithm not in ("ring", "tree"):
        raise ValueError(f"algorithm={algorithm!r} must be 'ring' or 'tree'")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    if group_size < 1:
        raise ValueError(f"group_size={group_size} must be >= 1")


def collective_terms(kind: Kind, nbytes: float, group_size: int, algorithm: Algorithm = "ring") -> CollectiveTerms:
    """Latency steps and per-rank wire bytes of one collective on ``group_size`` ranks.

    ring: all_reduce 2(n-1) steps, 2(n-1)/n*S bytes; all_gather / reduce_scatter (n-1), (n-1)/n*S;
    all_to_all (n-1) pairwise steps, (n-1)/n*S; send_recv 1 step, S; broadcast (pipelined ring) n-1, S.
    tree: all_reduce 2*log2(n) steps with 2*S bytes (reduce then broadcast, pipelined);
    all_gather / reduce_scatter recursive doubling/halving log2(n) steps, (n-1)/n*S.
    """
    _check(kind, nbytes, group_size, algorithm)
    n = group_size
    if kind == "send_recv":
        return CollectiveTerms(1.0, float(nbytes))
    if n == 1:
        return CollectiveTerms(0.0, 0.0)
    frac = (n - 1) / n
    log_n = math.ceil(math.log2(n))
    if kind == "all_to_all":
        return CollectiveTerms(float(n - 1), frac * nbytes)
    if algorithm == "ring":
        if kind == "all_reduce":
            return CollectiveTerms(2.0 * (n - 1), 2.0 * frac * nbytes)
        if kind == "broadcast":
            return CollectiveTerms(float(n - 1), float(nbytes))
        return CollectiveTerms(float(n - 1), frac * nbytes)
    if kind == "all_reduce":
        return CollectiveTerms(2.0 * log_n, 2.0 * nbytes)
    if kind == "broadcast":
        return CollectiveTerms(float(log_n), float(nbytes))
    return CollectiveTerms(float(log_n), frac * nbytes)


MEASURED_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def bus_bandwidth(link: Link, nbytes: float, link_efficiency: float = 1.0) -> float:
    """Achieved bus bandwidth (bytes/s) of a ring collective of ``nbytes`` over ``link``: its
    measured curve where it has one (linear in log message size between points, the end
    values held beyond them), else bandwidth x ``link_efficiency``. The curve is measured
    end to end, so it already holds the per-step latency and the achieved efficiency."""
    pts = link.busbw
    if not pts:
        return link.bandwidth * link_efficiency
    if nbytes <= pts[0][0]:
        return pts[0][1]
    for (b0, w0), (b1, w1) in zip(pts, pts[1:]):
        if nbytes <= b1:
            x = math.log(nbytes / b0) / math.log(b1 / b0)
            return w0 + x * (w1 - w0)
    return pts[-1][1]


def collective_time(kind: Kind, nbytes: float, group_size: int, link: Link,
                    algorithm: Algorithm | Literal["auto"] = "ring", link_efficiency: float = 1.0) -> float:
    """Seconds for one collective over ``link``; ``auto`` takes the faster of ring and tree.
    Ring all-reduce / all-gather / reduce-scatter on a link with a measured bus-bandwidth curve
    take wire bytes / its bandwidth at this message size (latency included in the curve): the
    curve is an all-reduce's, and the other two move the same per-step chunks."""
    if link.busbw and algorithm == "ring" and kind in MEASURED_KINDS:
        _check(kind, nbytes, group_size, algorithm)
        terms = collective_terms(kind, nbytes, group_size, "ring")
        return terms.wire_bytes / bus_bandwidth(link, nbytes) if terms.wire_bytes else 0.0
    if algorithm == "auto":
        return min(collective_terms(kind, nbytes, group_size, a).time(link, link_efficiency)
                   for a in ("ring", "tree"))
    return collective_terms(kind, nbytes, group_size, algorithm).time(link, link_efficiency)


def wire_bytes(kind: Kind, nbytes: float, group_size: int, algorithm: Algorithm = "ring") -> float:
    """Bytes each rank sends for one collective (the 'volume' of Narayanan et al.)."""
    return collective_terms(kind, nbytes, group_size, algorithm).wire_bytes


def tp_layer_collectives(b: int, s: int, h: int, tp: int, sequence_parallel: bool,
                         dtype_bytes: int = 2) -> list[tuple[str, float, int]]:
    """The tensor-parallel collectives of one Megatron transformer layer, forward and backward.

    Without SP: all-reduce of b*s*h after attention and after the MLP, forward and backward (4).
    With SP each all-reduce becomes all-gather + reduce-scatter of the same full size (8).
    Returns (kind, full bytes, group size) triples; sum their :func:`wire_bytes` for the volume.
    """
    full = float(b * s * h * dtype_bytes)
    if sequence_parallel:
        return [("all_gather", full, tp), ("reduce_scatter", full, tp)] * 4
    return [("all_reduce", full, tp)] * 4
