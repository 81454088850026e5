"""A precision asked for by name -- ``auto``, ``bf16``, ``fp8-tensorwise``, ``fp8-rowwise`` -- applied
to a plan: what ``autoplan train --precision`` means.

``auto`` keeps a plan's precision section as it is (a plan without one trains in the model's own
dtype: the planner's per-module proposal, ``choose``, is reviewed and written into a plan, never
applied unasked at launch); ``bf16`` removes every float8
module (the model's own dtype everywhere); ``fp8-<recipe>`` puts every Linear float8 can take on
the plan's shards in that recipe -- the head, routers and shapes it cannot take stay in high
precision, each with a note. On a device without float8 GEMMs the forced recipes run emulated
(slower, the same numbers as float8 hardware's casts); the plan notes it.
"""
from __future__ import annotations

import torch.nn as nn

from autoplan.arguments import PRECISIONS, check_precision
from autoplan.errors import InvalidArgumentError
from autoplan.precision.choose import choose_precision
from autoplan.precision.eligible import float8_sites
from autoplan.precision.section import float8_section, precision_notes

__all__ = ["PRECISIONS", "with_precision", "decide_precision"]


def with_precision(plan, model: nn.Module, precision: str):
    """``plan`` with its precision section set as ``precision`` asks (a copy; ``auto``: unchanged).

    ``auto`` keeps what the plan states and adds nothing: float8 changes a run's numerics, so it is
    applied only where the plan or the user asked for it, never chosen afresh at launch.
    """
    check_precision(precision, "with_precision")
    if precision == "auto":
        return plan
    section, notes = decide_precision(plan, model, precision)
    old = [n for n in plan.notes if not n.startswith("precision: ")]
    return plan.replace(parallel={**plan.parallel, "precision": section}, notes=old + notes)


def decide_precision(plan, model: nn.Module, precision: str, *, tokens: float | None = None,
                     compiled: bool | None = None) -> tuple[dict | None, list[str]]:
    """(the precision section, its notes) ``precision`` gives ``plan``'s Linears as the planner
    means it: "bf16" none in float8; "auto" float8 where it is cheaper on the plan's hardware at
    ``tokens`` rows a call (``choose``); "fp8-<recipe>" every Linear that can take the recipe on
    the plan's shards (an InvalidArgumentError when none can)."""
    check_precision(precision, "precision")
    if precision == "bf16":
        return None, []
    experts = any("expert" in fqn.rsplit(".", 1)[-1] for fqn, _ in model.named_modules())
    if precision == "auto":
        section = choose_precision(plan, model, tokens=tokens, compiled=compiled)
        if section is None:
            return None, ["precision: float8 pays for no Linear on this plan's hardware and shards (all kept in "
                          "the model's dtype)"]
        return section, precision_notes(section, experts=experts)
    recipe = precision.removeprefix("fp8-")
    sites, kept = float8_sites(model, plan, recipe)
    if not sites:
        raise InvalidArgumentError(f"precision={precision!r}: no Linear of {type(model).__name__} can take float8 on "
                                   f"this plan's shards ({'; '.join(f'{k}: {v}' for k, v in list(kept.items())[:3])})")
    section = float8_section(plan, {s.fqn: recipe for s in sites}, kept)
    return section, precision_notes(section, experts=experts)
