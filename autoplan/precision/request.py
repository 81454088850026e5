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

from autoplan.errors import InvalidArgumentError
from autoplan.precision.eligible import float8_sites
from autoplan.precision.section import float8_section, precision_notes

PRECISIONS = ("auto", "bf16", "fp8-tensorwise", "fp8-rowwise")


def check_precision(value: str, where: str = "precision") -> str:
    if value not in PRECISIONS:
        raise InvalidArgumentError(f"{where}={value!r} is not a precision; valid: {list(PRECISIONS)}")
    return value


def with_precision(plan, model: nn.Module, precision: str):
    """``plan`` with its precision section set as ``precision`` asks (a copy; ``auto``: unchanged).

    ``auto`` keeps what the plan states and adds nothing: float8 changes a run's numerics, so it is
    applied only where the plan or the user asked for it, never chosen afresh at launch.
    """
    check_precision(precision)
    if precision == "auto":
        return plan
    old = [n for n in plan.notes if not n.startswith("precision: ")]
    experts = any("expert" in fqn.rsplit(".", 1)[-1] for fqn, _ in model.named_modules())
    if precision == "bf16":
        return _with_section(plan, None, old)
    recipe = precision.removeprefix("fp8-")
    sites, kept = float8_sites(model, plan, recipe)
    if not sites:
        raise InvalidArgumentError(f"precision={precision!r}: no Linear of {type(model).__name__} can take float8 on "
                                   f"this plan's shards ({'; '.join(f'{k}: {v}' for k, v in list(kept.items())[:3])})")
    section = float8_section(plan, {s.fqn: recipe for s in sites}, kept)
    return _with_section(plan, section, old + precision_notes(section, experts=experts))


def _with_section(plan, section: dict | None, notes: list[str]):
    """A copy of ``plan`` with ``section`` as its precision and ``notes`` as its notes."""
    return plan.replace(parallel={**plan.parallel, "precision": section}, notes=notes)
