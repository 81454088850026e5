"""A sequence-parallel unit's tensor-parallel collectives under async TP: which matmul each one
is fused with, and what it still costs.

Which pairs fuse is what torch's micro-pipeline pass fuses (``autoplan.verify.async_tp`` counts it
on the plan's own block). It rewrites ``all_gather -> mm`` and ``mm -> reduce_scatter``, nothing
else, so on a unit whose weight GEMMs run in graph order -- the ones reading the gathered stream
(q/k/v, gate/up), then the one making the unit's output (o, down):
- the forward all-gather hides behind the input GEMMs that add no bias in the same op (a biased
  Linear is an ``addmm``: Qwen2's q/k/v, GPT-2's Conv1D);
- the forward reduce-scatter (also in a recomputed forward) behind the output GEMM, if unbiased;
- the backward all-gather of the output gradient behind the output GEMM's input gradient;
- the backward reduce-scatter of the input gradient only when one input GEMM makes it: q/k/v
  (gate/up) gradients are summed first, which the pass does not fuse; a packed qkv (Phi-3) fuses.
Checked against the pass on Llama, Qwen3, Mistral, Phi-3 and GPT-2 blocks. What a fused pair
costs: ``CostContext.fused_tp_time``.
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
    # (flops, M, N, K, split, biased) of the weight GEMMs, in graph order
    weights = [g for g in gemms if len(g) > 5 and g[4] in ("n", "k")]
    inputs, output = weights[:-1], weights[-1:]
    plain = [g for g in inputs if not g[5]]
    beside = {("all_gather", "forward"): plain,
              ("reduce_scatter", "forward"): [g for g in output if not g[5]],
              ("all_gather", "backward"): output,
              ("reduce_scatter", "backward"): inputs if len(inputs) == 1 else []}

    def cost(c: Collective, phase: str) -> float:
        if c.kind not in FUSABLE:
            return ctx.collective_time(c)
        return ctx.fused_tp_time(c, beside.get((c.kind, phase), []), shard)

    forward = sum(cost(c, "forward") for c in own if c.phase == "forward")
    backward = sum(cost(c, "backward") for c in own if c.phase != "forward") + \
        sum(cost(c, "forward") for c in recomputed)   # a recomputed forward fuses as the forward does
    return forward, backward
