"""The planner's per-module precision: float8 for each Linear where it is cheaper, priced on the
plan's hardware at the shape one rank runs.

Each eligible Linear (``eligible``) is priced twice by ``cost_models.precision``: its three GEMMs in
bf16, and in float8 plus the six casts torchao makes. Float8 is chosen where it is cheaper; a
Linear where it is not (a small GEMM whose casts cost more than the faster GEMM saves) stays in
high precision with both times in its reason. On hardware without a float8 peak (A100, Ascend,
the CPU profile) nothing is priced and nothing is chosen. The cluster search makes the same choice
per GEMM while it prices a layout (``CostContext.weight_gemm``, the same terms), at the rows one
call runs (micro-batch x sequence / cp), and the plan it returns is decided at those rows; a plan
decided afresh defaults to its tokens per rank per step (global batch x sequence over the
data-parallel and expert ranks). A tensor-parallel shard narrows a Linear's K or N.
"""
from __future__ import annotations

import torch.nn as nn

from autoplan.parallelisms.registry import batch_shards
from autoplan.precision.eligible import float8_sites
from autoplan.precision.section import float8_section
from cost_models.hardware import load_hardware
from cost_models.precision import float8_peak, linear_cost


def choose_float8(plan, model: nn.Module, recipe: str = "tensorwise", *, tokens: float | None = None,
                  compiled: bool | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """({fqn: recipe} where float8 is cheaper, {fqn: why not} for every other Linear).

    ``tokens``: rows one rank's Linears run per call (the cluster search's micro-batch x sequence
    / cp, which is what it priced); default the plan's tokens per rank per step. ``compiled``:
    the casts run compiled (default: as the plan's ``predictions["compile"]`` says)."""
    hardware = load_hardware(plan.mesh["hardware"])
    sites, kept = float8_sites(model, plan, recipe)
    if float8_peak(hardware, recipe) is None:
        return {}, {**kept, **{s.fqn: f"{hardware.name} has no float8 GEMM (no peak_flops.fp8 in its profile)"
                               for s in sites}}
    if tokens is None:
        tokens = plan.batch["global_batch"] * plan.batch["seq_len"] / max(1, batch_shards(plan))
    if compiled is None:
        compiled = (plan.predictions or {}).get("compile", "none") != "none"
    chosen = {}
    for s in sites:
        cost = linear_cost(hardware, tokens, s.in_features / s.shards[0], s.out_features / s.shards[1], recipe,
                           compiled=compiled)
        if cost.saving_s > 0:
            chosen[s.fqn] = recipe
        else:
            kept[s.fqn] = (f"float8 does not pay: {cost.gemm_bf16_s * 1e3:.3g} ms in bf16 vs {cost.float8_s * 1e3:.3g} "
                           f"ms in float8 ({cost.cast_s * 1e3:.3g} ms of casts) per call")
    return chosen, kept


def choose_precision(plan, model: nn.Module, recipe: str = "tensorwise", *, tokens: float | None = None,
                     compiled: bool | None = None) -> dict | None:
    """The plan section the planner's choice gives (None: every module in high precision)."""
    chosen, kept = choose_float8(plan, model, recipe, tokens=tokens, compiled=compiled)
    return float8_section(plan, chosen, kept)
