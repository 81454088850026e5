"""A sequence-parallel unit's tensor-parallel collectives under async TP: which matmul each one
is fused with, and what it still costs.

Which pairs fuse is what torch's micro-pipeline pass fuses on our styles (``autoplan.verify.async_tp``
counts it on the plan's own block; measured on Llama-shaped blocks): the forward all-gather with
the column-parallel GEMMs that read the gathered input; the forward reduce-scatter with the
row-parallel GEMM that feeds it (so also in a recomputed forward); the backward all-gather of the
output gradient with the row-parallel GEMM's input gradient; the backward reduce-scatter of the
input gradient only when one column GEMM makes it -- q/k/v (or gate/up) gradients are summed
first, which the pass does not fuse. What a fused pair costs: ``CostContext.fused_tp_time``.
"""
from __future__ import annotations

from typing import Sequence

from autoplan.search.pricing.costing import CostContext
from hyper_parallel.core.collective import Collective

FUSABLE = ("all_gather", "reduce_scatter")


def async_tp_exposed(ctx: CostContext, gemms: Sequence, shard: int, own: Sequence[Collective],
                     recomputed: Sequence[Collective]) -> tuple[float, float]:
    """(forward, backward) seconds of a unit's tensor-parallel collectives under async TP.
    ``gemms``: the unit's GEMMs (``Work.gemms``); ``own``: its collectives (all its calls);
    ``recomputed``: the forward ones a recomputed forward issues again, in backward."""
    cols = [g for g in gemms if len(g) > 4 and g[4] == "n"]
    rows = [g for g in gemms if len(g) > 4 and g[4] == "k"]
    beside = {("all_gather", "forward"): cols, ("reduce_scatter", "forward"): rows,
              ("all_gather", "backward"): rows, ("reduce_scatter", "backward"): cols if len(cols) == 1 else []}

    def cost(c: Collective, phase: str) -> float:
        if c.kind not in FUSABLE:
            return ctx.collective_time(c)
        return ctx.fused_tp_time(c, beside.get((c.kind, phase), []), shard)

    forward = sum(cost(c, "forward") for c in own if c.phase == "forward")
    backward = sum(cost(c, "backward") for c in own if c.phase != "forward") + \
        sum(cost(c, "forward") for c in recomputed)   # a recomputed forward fuses as the forward does
    return forward, backward
