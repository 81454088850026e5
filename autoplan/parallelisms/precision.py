"""Precision: which Linears train in float8, with which recipe -- a per-module decision of a plan.

Plan section ``parallel.precision``: null (every GEMM in the model's own dtype), or

    {"modules": {"layers.*.attention.wq": "tensorwise", ...},   # pattern -> recipe
     "kept": {"output": "the head: ...", ...},                   # modules kept in high precision, why
     "fsdp_float8_all_gather": true}                             # FSDP2 gathers tensorwise weights in float8

Applied first (before tensor parallel and the pipeline cut): the named Linears become torchao's
float8 Linears (``hyper_parallel.core.float8.convert_to_float8``), so every style, stage and FSDP
unit after takes them as it takes any Linear. Float8 all-gather applies to the Linears inside the
repeated blocks only: each block is its own FSDP unit, gathered after the scales are computed at
the root's forward (``scale_before_gather``); a Linear of the root's own unit would be gathered
before. Optional in a plan file: files written before precision existed load as null.
"""
from __future__ import annotations

import logging

from autoplan.parallelisms.base import ApplyTarget, Parallelism, section_error
from autoplan.parallelisms.data import dp_degree, plan_dp_mode
from hyper_parallel.core.float8 import RECIPES, convert_to_float8, scale_before_gather

log = logging.getLogger(__name__)


def precision_section(plan) -> dict | None:
    return (plan.parallel or {}).get("precision")


def float8_modules(plan) -> dict[str, str]:
    """{pattern: recipe} of the plan's float8 Linears ({} for a high-precision plan)."""
    section = precision_section(plan)
    return dict(section["modules"]) if section else {}


def precision_lines(plan, query: str) -> list[str]:
    """What the plan decided for the Linears at or under ``query`` (a module path or a unit's
    pattern): one line per float8 or kept pattern of the section, for ``explain``."""
    section = precision_section(plan)
    if not section:
        return []
    atoms = query.split(".")

    def hit(pattern: str) -> bool:
        parts = pattern.split(".")
        return len(parts) >= len(atoms) and all(
            a == b or "*" in a or "*" in b for a, b in zip(parts, atoms))
    lines = [f"precision: {p} in float8 ({r})" for p, r in section["modules"].items() if hit(p)]
    return lines + [f"precision: {p} kept in high precision: {why}" for p, why in section.get("kept", {}).items()
                    if hit(p)]


def plan_precision(plan) -> str:
    """One word for the plan's precision: ``bf16`` (no float8 module; the model's own dtype),
    ``fp8-<recipe>`` or ``fp8-mixed`` when modules use different recipes."""
    recipes = set(float8_modules(plan).values())
    if not recipes:
        return "bf16"
    return f"fp8-{recipes.pop()}" if len(recipes) == 1 else "fp8-mixed"


def _float8_gather(plan, target: ApplyTarget) -> dict[str, str]:
    """The float8 modules whose weights FSDP gathers in float8: tensorwise, under FSDP over more
    than one rank, inside a repeated block (each block its own FSDP unit)."""
    section = precision_section(plan)
    if not section or not section.get("fsdp_float8_all_gather") or plan_dp_mode(plan) != "fsdp" or dp_degree(plan) < 2:
        return {}
    prefixes = sorted({d["block_prefix"] for d in plan.decisions if d.get("block_prefix")})
    out = {}
    for pattern, recipe in section["modules"].items():
        inside = any(pattern.startswith(p + ".") for p in prefixes)
        if recipe == "tensorwise" and inside:
            out[pattern] = recipe
    return out


class Precision(Parallelism):
    """Not a mesh dimension: the per-module precision the runtime applies before anything else."""

    name = "precision"
    roles = ()
    order = 5   # before tensor parallel (10): styles shard the float8 Linears as any Linear
    optional = True
    schema = {"oneOf": [{"type": "null"}, {
        "type": "object", "required": ["modules"], "additionalProperties": False,
        "properties": {"modules": {"type": "object", "additionalProperties": {"enum": list(RECIPES)}},
                       "kept": {"type": "object", "additionalProperties": {"type": "string"}},
                       "fsdp_float8_all_gather": {"type": "boolean"}}}]}

    def check(self, section, data, roles, degree) -> None:
        if not section:
            return
        for pattern in section["modules"]:
            if not pattern or any(not atom for atom in pattern.split(".")):
                raise section_error("precision", "modules", f"{pattern!r} is not a module pattern")
            if pattern in section.get("kept", {}):
                raise section_error("precision", "kept", f"{pattern!r} is both float8 and kept in high precision")
        if section.get("fsdp_float8_all_gather") and "tensorwise" not in section["modules"].values():
            raise section_error("precision", "fsdp_float8_all_gather", "true, but no module uses the tensorwise "
                                "recipe (the only one FSDP can gather in float8)")

    def active(self, plan) -> bool:
        return bool(float8_modules(plan))

    def apply_to_model(self, plan, target: ApplyTarget) -> None:
        modules = float8_modules(plan)
        if not modules:
            return
        gather = _float8_gather(plan, target)
        rest = {p: r for p, r in modules.items() if p not in gather}
        done = convert_to_float8(target.model, gather, fsdp_float8_all_gather=True) if gather else None
        other = convert_to_float8(target.model, rest) if rest else None
        target.state["float8"] = [c for c in (done, other) if c is not None]
        log.info("precision: %d float8 Linears (%d gathered in float8)",
                  sum(len(c.modules) for c in target.state["float8"]), len(done.modules) if done else 0)

    def apply_to_roots(self, plan, target: ApplyTarget) -> None:
        if any(c.fsdp_float8_all_gather for c in target.state.get("float8", ())):
            for root in target.roots:
                scale_before_gather(root)
