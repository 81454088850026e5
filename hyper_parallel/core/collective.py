"""One collective, as the runtime issues it and as plans, the cost model and verify speak of it.

Every prediction of traffic in this project (a tensor-parallel strategy's collectives, FSDP's
per-unit gathers and reduce-scatters, HSDP's replicate all-reduces, expert parallel's
all-to-alls, context parallel's ring exchanges) is a list of ``Collective``; a plan stores them as
rows (``to_row``) and verify compares those rows with what ``hyper_parallel.local.CollectiveRecorder``
saw, keyed the same way (``key``).

Bytes follow cost_models' convention: the full logical tensor (gathered / pre-scatter / reduced),
so one number prices the collective on any group size.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Iterable

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
PHASES = ("forward", "backward")


@dataclass(frozen=True)
class Collective:
    kind: str            # one of KINDS
    phase: str           # forward | backward
    nbytes: int          # logical bytes of one call
    count: int = 1       # calls (per unit call for a strategy, per step in a plan row)
    dim: str = "tp"      # the mesh dimension (its name in the plan's mesh) the group spans
    # reduces a parameter's gradient and nothing else (a replicated weight on a sequence shard):
    # a backward pass that asks only for input gradients does not issue it. Not part of the row.
    weight_grad: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Collective: kind {self.kind!r} is not one of {KINDS}")
        if self.phase not in PHASES:
            raise ValueError(f"Collective: phase {self.phase!r} is not one of {PHASES}")

    def scaled(self, n: int) -> "Collective":
        """``n`` times as many calls."""
        return replace(self, count=self.count * n)

    def scaled_bytes(self, n: int) -> "Collective":
        """The same collective on ``n`` times the tokens (bytes proportional to the batch)."""
        return replace(self, nbytes=self.nbytes * n)

    def on(self, dim: str) -> "Collective":
        """The same collective over mesh dimension ``dim``."""
        return replace(self, dim=dim)

    @property
    def key(self) -> tuple[str, str, str, int]:
        """What verify matches predicted and issued traffic on: (kind, mesh_dim, phase, bytes)."""
        return (self.kind, self.dim, self.phase, int(self.nbytes))

    def to_row(self) -> dict:
        """The plan file's row: exact integers, the mesh dimension by name."""
        return {"kind": self.kind, "mesh_dim": self.dim, "phase": self.phase, "bytes": int(self.nbytes),
                "count": int(self.count)}

    @classmethod
    def from_row(cls, row: dict) -> "Collective":
        return cls(row["kind"], row["phase"], int(row["bytes"]), int(row.get("count", 1)), row["mesh_dim"])


def merged_rows(collectives: Iterable[Collective]) -> list[dict]:
    """Plan rows with equal keys merged (counts summed), sorted by key: the form plans store."""
    counts: Counter = Counter()
    for c in collectives:
        counts[c.key] += c.count
    return [Collective(k, p, b, n, d).to_row() for (k, d, p, b), n in sorted(counts.items())]
