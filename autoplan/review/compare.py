"""``compare_plans(plans)``: candidate plans side by side, one row each, for notebooks and the CLI.

The columns are what decides between plans: predicted step time (and its compute /
communication split, and what it was priced as running: compiled, float8, overlapped), throughput in tokens per second (total and per device), memory per rank
by kind, the layout choices, and how far each is from the best. Optionally one column per unit
with its strategy, so one sees *where* two plans differ.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from autoplan.errors import AutoplanError


def _name(plan, i: int) -> str:
    return str(plan.model.get("plan_name") or plan.model.get("source") or f"plan{i}")


def _float8(plan) -> str:
    """The float8 recipes of a plan's precision section and how many Linears each runs ("-": none)."""
    modules = (plan.parallel.get("precision") or {}).get("modules") or {}
    counts: dict[str, int] = {}
    for recipe in modules.values():
        counts[recipe] = counts.get(recipe, 0) + 1
    return ", ".join(f"{r} x{n}" for r, n in sorted(counts.items())) or "-"


def plan_row(plan) -> dict[str, Any]:
    """The comparison columns of one plan."""
    pred, mesh = plan.predictions, plan.mesh
    devices = 1
    for s in mesh["shape"]:
        devices *= int(s)
    gb, seq = plan.batch.get("global_batch"), plan.batch.get("seq_len")
    tokens = gb * seq if gb and seq else None
    step = float(pred["step_s"])
    mem = pred.get("memory_bytes", {})
    pipe = plan.pipeline or {}
    row = {
        "mesh": "x".join(f"{n}{s}" for n, s in zip(mesh["names"], mesh["shape"])),
        "hardware": mesh.get("hardware"), "devices": devices,
        "stream": plan.stream_layout, "loss_parallel": plan.loss_parallel,
        "fsdp": bool(plan.fsdp.get("enabled")), "act_ckpt": bool(plan.activation_checkpointing),
        "pp": int(pipe.get("pp", 1)), "schedule": pipe.get("schedule", "-"),
        # how the step was priced as running: compiled, float8 linears, communication hidden
        "compile": pred.get("compile", "none"), "float8": _float8(plan), "overlap": pred.get("overlap", "none"),
        "step_s": step, "compute_s": float(pred["compute_s"]), "comm_s": float(pred["comm_s"]),
        "comm_fraction": float(pred["comm_s"]) / step if step else float("nan"),
        "tokens_per_s": tokens / step if tokens and step else float("nan"),
        "tokens_per_s_per_device": tokens / step / devices if tokens and step else float("nan"),
    }
    for kind in ("params", "grads", "optimizer", "activations", "total"):
        if kind in mem:
            row[f"mem_{kind}_gib"] = float(mem[kind]) / 2**30
    return row


def compare_plans(plans: Iterable | Mapping, names: list[str] | None = None, *, strategies: bool = False):
    """DataFrame, one row per plan (index = name), sorted as given, with ``vs_best`` = step / best step.

    ``plans`` is a list of Plans (names from ``names``, else the plan's recorded name) or a
    {name: Plan} mapping. ``strategies=True`` adds one ``unit:<name>`` column per unit.
    """
    import pandas as pd

    if isinstance(plans, Mapping):
        names, plans = list(plans.keys()), list(plans.values())
    plans = list(plans)
    if not plans:
        raise AutoplanError("compare_plans: no plans given")
    if names is None:
        names = [_name(p, i) for i, p in enumerate(plans)]
    if len(names) != len(plans):
        raise AutoplanError(f"compare_plans: {len(names)} names for {len(plans)} plans")
    if len(set(names)) != len(names):
        names = [f"{n}#{i}" for i, n in enumerate(names)]
    rows = []
    for plan in plans:
        row = plan_row(plan)
        if strategies:
            row.update({f"unit:{d['unit']}": f"{d['strategy']}[{d.get('stream', '-')}]" for d in plan.decisions})
        rows.append(row)
    frame = pd.DataFrame(rows, index=pd.Index(names, name="plan"))
    frame.insert(frame.columns.get_loc("step_s") + 1, "vs_best", frame["step_s"] / frame["step_s"].min())
    return frame
