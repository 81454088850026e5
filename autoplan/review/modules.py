"""``module_table(plan)``: one row per module pattern -- its style, layouts and its unit's cost.

``plan.summary()`` has one row per unit (a group of modules solved together, e.g. a block's
attention). A reviewer reading the plan module by module wants the other view: for every
pattern the style and its input/output layouts, next to the unit that chose it and that unit's
predicted compute, communication and memory.
"""
from __future__ import annotations

from typing import Any

COLUMNS = ["module", "style", "input_layouts", "output_layouts", "unit", "strategy", "stream", "compute_s", "comm_s",
           "memory_bytes"]


def _layouts(args: dict[str, Any], *keys: str) -> str:
    for key in keys:
        if key in args:
            value = args[key]
            return ", ".join("-" if v is None else str(v) for v in value) if isinstance(value, list) else str(value)
    return "default"


def module_table(plan):
    """DataFrame, one row per style pattern of the plan (sorted by pattern)."""
    import pandas as pd

    owner = {}
    for d in plan.decisions:
        for pattern in d.get("modules", []):
            owner.setdefault(pattern, d)
    rows = []
    for pattern, spec in sorted(plan.styles.items()):
        args = spec.get("args", {})
        d = owner.get(pattern, {})
        rows.append({
            "module": pattern, "style": spec["style"],
            "input_layouts": (f"{_layouts(args, 'input_layouts')} -> {_layouts(args, 'desired_input_layouts')}"
                              if "desired_input_layouts" in args else _layouts(args, "input_layouts")),
            "output_layouts": _layouts(args, "output_layouts"),
            "unit": d.get("unit", "-"), "strategy": d.get("strategy", "-"), "stream": d.get("stream", "-"),
            "compute_s": d.get("compute_s", float("nan")), "comm_s": d.get("comm_s", float("nan")),
            "memory_bytes": d.get("memory_bytes", float("nan")),
        })
    return pd.DataFrame(rows, columns=COLUMNS)
