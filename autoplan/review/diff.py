"""``diff(plan_a, plan_b)``: what differs between two plans, as one DataFrame.

Reviewing a change (a new planner version, another mesh, the expert plan) is reading the
differences only: settings, styles per module pattern, float8 recipe per module pattern, what the
step was priced as running (compiled, overlapped), strategy per unit, predictions and collectives. Each row is (section, key, a, b, change); identical plans give an empty frame.
"""
from __future__ import annotations

from typing import Any

from autoplan.parallelisms.precision import float8_modules

COLUMNS = ["section", "key", "a", "b", "change"]
_SETTINGS = ("tp_dim", "dp_dim", "stream_layout", "loss_parallel", "activation_checkpointing")


def _change(a: Any, b: Any) -> Any:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return f"{(b - a) / a:+.1%}" if a else f"{b - a:+.4g}"
    if a is None:
        return "added"
    if b is None:
        return "removed"
    return "changed"


def _style_text(spec: dict | None) -> str | None:
    if spec is None:
        return None
    args = ", ".join(f"{k}={v}" for k, v in sorted(spec.get("args", {}).items()))  # JSON sorts keys
    return f"{spec['style']}({args})"


def _collective_totals(plan) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in plan.predictions.get("collectives", []):
        key = f"{c['kind']}/{c['mesh_dim']}/{c['phase']}"
        out[key] = out.get(key, 0.0) + float(c["bytes"]) * int(c["count"])
    return out


def diff(plan_a, plan_b, *, rel_tol: float = 1e-6):
    """DataFrame of the differences (columns section, key, a, b, change); empty when equal.

    Numbers within ``rel_tol`` are equal (a plan read back from JSON keeps 9 significant digits)."""
    import pandas as pd

    rows: list[tuple] = []

    def add(section: str, key: str, a: Any, b: Any, numeric: bool = False) -> None:
        if numeric and a is not None and b is not None:
            if abs(a - b) <= rel_tol * max(abs(a), abs(b), 1e-30):
                return
        elif a == b:
            return
        rows.append((section, key, a, b, _change(a, b)))

    ma, mb = plan_a.mesh, plan_b.mesh
    add("mesh", "mesh", dict(zip(ma["names"], ma["shape"])), dict(zip(mb["names"], mb["shape"])))
    add("mesh", "hardware", ma.get("hardware"), mb.get("hardware"))
    for k in _SETTINGS:
        add("setting", k, getattr(plan_a, k), getattr(plan_b, k))
    add("setting", "fsdp", plan_a.fsdp.get("enabled"), plan_b.fsdp.get("enabled"))
    pa, pb = plan_a.pipeline or {}, plan_b.pipeline or {}
    for k in ("pp", "schedule", "microbatches", "virtual_stages", "cuts"):
        add("pipeline", k, pa.get(k), pb.get(k))
    for pattern in sorted(set(plan_a.styles) | set(plan_b.styles)):
        add("style", pattern, _style_text(plan_a.styles.get(pattern)), _style_text(plan_b.styles.get(pattern)))
    fa, fb = float8_modules(plan_a), float8_modules(plan_b)   # pattern -> float8 recipe
    for pattern in sorted(set(fa) | set(fb)):
        add("precision", pattern, fa.get(pattern), fb.get(pattern))
    for k in ("compile", "overlap"):
        add("priced_as", k, plan_a.predictions.get(k, "none"), plan_b.predictions.get(k, "none"))
    da = {d["unit"]: f"{d['strategy']} [{d.get('stream', '-')}]" for d in plan_a.decisions}
    db = {d["unit"]: f"{d['strategy']} [{d.get('stream', '-')}]" for d in plan_b.decisions}
    for unit in sorted(set(da) | set(db)):
        add("decision", unit, da.get(unit), db.get(unit))
    for k in ("step_s", "compute_s", "comm_s"):
        add("prediction", k, plan_a.predictions.get(k), plan_b.predictions.get(k), numeric=True)
    mem_a, mem_b = plan_a.predictions.get("memory_bytes", {}), plan_b.predictions.get("memory_bytes", {})
    for k in sorted(set(mem_a) | set(mem_b)):
        add("memory_bytes", k, mem_a.get(k), mem_b.get(k), numeric=True)
    ca, cb = _collective_totals(plan_a), _collective_totals(plan_b)
    for k in sorted(set(ca) | set(cb)):
        add("collective_bytes", k, ca.get(k), cb.get(k), numeric=True)
    return pd.DataFrame(rows, columns=COLUMNS)
