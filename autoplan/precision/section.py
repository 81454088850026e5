"""The plan section ``parallel.precision`` from per-module decisions, and the notes that say why.

``float8_section`` turns {fqn: recipe or None} into the section's patterns: a module kept in high
precision is listed under ``kept`` with its reason, and the float8 ones under ``modules``, both
folded over repeated blocks only where every block agrees (a pattern never reaches a module
decided the other way). FSDP gathers the tensorwise weights in float8 whenever the plan shards
parameters with FSDP: the weight crosses the network in one byte instead of two, and the scale it
needs is computed once per step beside the gather (``hyper_parallel.core.float8.fsdp``).
"""
from __future__ import annotations

from autoplan.parallelisms.data import dp_degree, plan_dp_mode
from autoplan.precision.eligible import as_patterns

KEPT = "-"


def float8_section(plan, chosen: dict[str, str], kept: dict[str, str]) -> dict | None:
    """The section for ``chosen`` ({fqn: recipe}) and ``kept`` ({fqn: reason}); None when nothing
    is float8 (a plan in the model's own precision)."""
    if not chosen:
        return None
    folded = as_patterns({**{f: KEPT for f in kept}, **chosen})
    modules = {p: r for p, r in folded.items() if r != KEPT}
    reasons = {}
    for pattern in (p for p, r in folded.items() if r == KEPT):
        members = [f for f in kept if f == pattern or _member(pattern, f)]
        reasons[pattern] = kept[members[0]] if members else "kept"
    gather = plan_dp_mode(plan) == "fsdp" and bool(plan.fsdp.get("enabled")) and dp_degree(plan) > 1
    return {"modules": dict(sorted(modules.items())), "kept": dict(sorted(reasons.items())),
            "fsdp_float8_all_gather": gather and "tensorwise" in modules.values()}


def _member(pattern: str, fqn: str) -> bool:
    a, b = pattern.split("."), fqn.split(".")
    return len(a) == len(b) and all(x == "*" or x == y for x, y in zip(a, b))


def precision_notes(section: dict | None, *, experts: bool = False) -> list[str]:
    """One plan note per kept pattern, and one for experts when the model has them."""
    if not section:
        return []
    notes = [f"precision: {p} kept in high precision: {why}" for p, why in section["kept"].items()]
    if experts:
        notes.append("precision: experts run in high precision (torch's grouped GEMM): torchao's float8 grouped "
                     "GEMM is a prototype without an emulated path, so no plan here can check it")
    return notes
