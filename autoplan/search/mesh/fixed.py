"""One fixed layout (an expert's, a published run's) priced with the cluster search's costs.

Why apart from the search: the search visits many layouts and keeps the fastest that fits; this
prices the one a caller names -- even or balanced cuts, any cp / ep / pp combination -- and says
why it cannot run (cannot be cut, does not fit). ``ClusterSearch.evaluate`` is this function.
"""
from __future__ import annotations

from typing import Mapping

from autoplan.errors import InfeasiblePlanError, PlanningError
from autoplan.search.mesh.candidates import Candidate
from autoplan.search.pipeline.search import PipelineChoice, even_starts, pipeline_candidates, time_choice
from hyper_parallel.core.pipeline_parallel import schedule_facts


def evaluate_layout(self, degrees: Mapping[str, int], schedule: str = "1F1B", b: int = 1, fsdp=True,
                    ac=None, cuts: str = "even", v: int = 1) -> Candidate:
    """Price one fixed plan (e.g. an expert's) with the same costs: even or balanced cuts;
    ``ac=None`` takes the faster fitting of with/without activation checkpointing.
    ``degrees``: ``dp``, ``pp`` and ``tp``, and ``cp`` / ``ep`` (1 when left out); any cp / ep
    / pp combination is priced."""
    unknown = sorted(set(degrees) - {"dp", "pp", "tp", "cp", "ep"})
    if unknown or any(k not in degrees for k in ("dp", "pp", "tp")):
        raise PlanningError(f"evaluate: degrees {dict(degrees)} must name dp, pp and tp (and may name cp, ep); "
                            f"unknown: {unknown}")
    dp, pp, tp = int(degrees["dp"]), int(degrees["pp"]), int(degrees["tp"])
    cp, ep = int(degrees.get("cp", 1)), int(degrees.get("ep", 1))
    if self.gb % (dp * ep * b):
        raise InfeasiblePlanError(f"evaluate: global batch {self.gb} not divisible by dp*ep*b = {dp * ep * b}")
    m = self.gb // (dp * ep * b)
    best = None
    for a in ([False, True] if ac is None else [ac]):
        self.settle(tp, b, a, cp, ep)   # priced as it would run
        uc = self.unit_costs(dp, pp, tp, fsdp, a, b, cp, ep)
        if uc is None:
            continue
        units, p2p = uc
        vv = schedule_facts(schedule).stages_per_rank(v)
        if cuts == "even":
            starts = even_starts(len(units), pp * vv)
        else:
            c0 = [c for c in pipeline_candidates(units, pp, [m], self.limit, [schedule], [v], False)]
            starts = c0[0].starts if c0 else None
        if starts is None:
            continue
        c = time_choice(PipelineChoice(schedule, pp, vv, m, starts, cut_method=cuts), units, p2p,
                        self.exposed(fsdp if dp * cp * ep > 1 else "fsdp"))
        fits = max(c.rank_memory) <= self.limit
        cand = Candidate(dp, pp, tp, fsdp, a, b, c, cp, ep)
        if best is None or (fits, -c.step_s) > (best[0], -best[1].step_s):
            best = (fits, cand)
    if best is None:
        raise InfeasiblePlanError(f"evaluate: dp{dp} pp{pp} tp{tp} cp{cp} ep{ep} {schedule} cannot be cut")
    cand = best[1]
    if not best[0]:
        raise InfeasiblePlanError(f"evaluate: dp{dp} pp{pp} tp{tp} cp{cp} ep{ep} {schedule} b={b} does not fit "
                                  f"({max(cand.choice.rank_memory) / 2**30:.1f} GiB > {self.limit / 2**30:.1f})")
    return cand
