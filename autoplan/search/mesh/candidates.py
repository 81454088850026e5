"""The cluster search's candidates: the dp x pp x tp factorizations it visits, one whole plan
(:class:`Candidate`: degrees, dp mode, recomputation, micro-batch size, the timed pipeline), the
names of dp modes and recomputation (older bools read as names), and the ranked alternatives a
plan lists. What the search does with them lives in ``autoplan.search.mesh.search``."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from autoplan.errors import PlanningError
from autoplan.search.pricing.costing import RECOMPUTE
from autoplan.search.pipeline.search import PipelineChoice
from cost_models.overlap import DP_MODES

MESH_NAMES = ("dp", "pp", "tp")


def _mode_name(value, names: tuple[str, ...], what: str, when_true: str, when_false: str) -> str:
    """One of ``names`` from a name or the older bool (True: ``when_true``)."""
    if isinstance(value, str):
        if value not in names:
            raise PlanningError(f"{what}={value!r} is not one of {names}")
        return value
    return when_true if value else when_false


def dp_mode_of(fsdp) -> str:
    """A dp mode name from a mode name or the older bool (True: FSDP, False: replicated)."""
    return _mode_name(fsdp, DP_MODES, "dp_mode", "fsdp", "replicate")


def recompute_of(ac) -> str:
    """A recompute name from a name or the older bool (True: full checkpointing, False: none)."""
    return _mode_name(ac, RECOMPUTE, "recompute", "full", "none")


@dataclass
class Candidate:
    """One whole plan: mesh degrees, data-parallel mode, checkpointing, micro-batch size and the
    timed pipeline."""

    dp: int
    pp: int
    tp: int
    fsdp: bool | str            # dp mode; a bool is read as FSDP / replicated
    ac: bool | str              # recompute; a bool is read as full / none
    b: int
    choice: PipelineChoice
    cp: int = 1                 # context parallel degree (a dimension after dp)
    ep: int = 1                 # expert parallel degree (borrowed from dp: the batch is split dp x ep ways)

    def __post_init__(self) -> None:
        self.dp_mode, self.recompute = dp_mode_of(self.fsdp), recompute_of(self.ac)
        self.fsdp, self.ac = self.dp_mode == "fsdp", self.recompute == "full"

    @property
    def step_s(self) -> float:
        return self.choice.step_s

    @property
    def key(self) -> tuple:
        c = self.choice
        return (self.step_s, self.dp, self.pp, self.tp, self.cp, self.ep, DP_MODES.index(self.dp_mode),
                RECOMPUTE.index(self.recompute), self.b, c.schedule, c.v, c.starts)

    @property
    def mesh(self) -> dict[str, int]:
        """Degrees by dimension name, in mesh order (cp / ep only when used)."""
        out = {"dp": self.dp}
        if self.cp > 1:
            out["cp"] = self.cp
        if self.ep > 1:
            out["ep"] = self.ep
        return dict(out, pp=self.pp, tp=self.tp)

    def summary(self, units: Sequence[str]) -> dict[str, Any]:
        c = self.choice
        name = "-".join(f"{k}{v}" for k, v in self.mesh.items())
        return {"name": f"{name}-{c.schedule}-m{c.m}", "step_s": c.step_s, "mesh": self.mesh, "schedule": c.schedule,
                "virtual_stages": c.v, "microbatches": c.m, "microbatch_size": self.b, "fsdp": self.fsdp,
                "activation_checkpointing": self.ac, "dp_mode": self.dp_mode, "recompute": self.recompute, "bubble_fraction": c.bubble_fraction,
                "memory_bytes": max(c.rank_memory), "cuts": [units[s] for s in c.starts[1:]],
                "cut_method": c.cut_method}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def mesh_factorizations(devices: int, devices_per_node: int, max_pp: int,
                        constraints: dict | None = None) -> list[tuple[int, int, int]]:
    """(dp, pp, tp) with tp a divisor of the node size (tensor parallel stays on NVLink)."""
    cons = constraints or {}
    out = []
    for tp in divisors(math.gcd(devices, devices_per_node)):
        for pp in divisors(devices // tp):
            if pp > max_pp:
                continue
            dp = devices // (tp * pp)
            want = {"dp": dp, "pp": pp, "tp": tp}
            if all(cons.get(k) in (None, v) for k, v in want.items()):
                out.append((dp, pp, tp))
    return out


def ranked_alternatives(cands: Sequence[Candidate], units: Sequence[str], top: int = 10) -> list[dict]:
    """The best candidate of each distinct (mesh, schedule, dp mode), best first."""
    seen, out = set(), []
    for c in cands:
        k = (c.dp, c.pp, c.tp, c.cp, c.ep, c.choice.schedule, c.dp_mode)
        if k in seen:
            continue
        seen.add(k)
        out.append(c.summary(units))
        if len(out) >= top:
            break
    return out
