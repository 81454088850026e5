"""Per-stage table and the pipeline simulation behind the timeline plot.

A pipeline plan (``plan.pipeline``, pp > 1) records per stage its rank, unit range, compute,
exposed communication, bubble and the rank's memory. ``stage_table`` shows that as a DataFrame;
a plan without a pipeline is one stage (every rank holds the whole model), so the same table
and plots work for every plan. ``simulate_pipeline`` replays the schedule in hyper_parallel's
simulator from those stage costs, giving the per-rank timeline the plot draws.
"""
from __future__ import annotations

from typing import Any

from autoplan.errors import AutoplanError
from hyper_parallel import StageCost, simulate
from hyper_parallel.core.pipeline_parallel import schedule_facts

STAGE_COLUMNS = ["stage", "rank", "units", "compute_s", "comm_s", "bubble_s", "busy_fraction", "memory_bytes",
                 "memory_gib"]


def _compact(modules: list[str]) -> str:
    """["tok_embeddings", "layers.0", "layers.1", "layers.2"] -> "tok_embeddings, layers.0-2"."""
    out: list[str] = []
    run: tuple[str, int, int] | None = None
    for name in modules:
        prefix, _, idx = name.rpartition(".")
        if prefix and idx.isdigit():
            if run and run[0] == prefix and run[2] + 1 == int(idx):
                run = (prefix, run[1], int(idx))
                continue
            if run:
                out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = (prefix, int(idx), int(idx))
            continue
        if run:
            out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
            run = None
        out.append(name)
    if run:
        out.append(f"{run[0]}.{run[1]}" + (f"-{run[2]}" if run[2] != run[1] else ""))
    return ", ".join(out)


def _stages(plan) -> list[dict[str, Any]]:
    pipe = plan.pipeline
    if pipe and int(pipe.get("pp", 1)) > 1:
        rows = pipe.get("per_stage") or []
        if not rows:
            raise AutoplanError("stage_table: plan.pipeline has pp > 1 but no per_stage rows")
        names = pipe.get("stages") or []
        s2r = pipe.get("stage_to_rank") or []
        out = []
        for i, r in enumerate(rows):
            row = dict(r, stage=r.get("stage", i), rank=r.get("rank", s2r[i] if i < len(s2r) else i))
            if "units" not in row and i < len(names) and isinstance(names[i], list):
                row["units"] = _compact(names[i])
            out.append(row)
        return out
    pred = plan.predictions
    return [{"stage": 0, "rank": 0, "units": "all", "compute_s": pred["compute_s"], "comm_s": pred["comm_s"],
             "bubble_s": 0.0, "memory_bytes": pred["memory_bytes"].get("total", 0.0)}]


def stage_table(plan):
    """DataFrame, one row per pipeline stage (a single row without pipeline parallelism)."""
    import pandas as pd

    rows = []
    for r in _stages(plan):
        total = r["compute_s"] + r.get("comm_s", 0.0) + r.get("bubble_s", 0.0)
        rows.append({"stage": r["stage"], "rank": r["rank"], "units": str(r.get("units", "")),
                     "compute_s": r["compute_s"], "comm_s": r.get("comm_s", 0.0), "bubble_s": r.get("bubble_s", 0.0),
                     "busy_fraction": r["compute_s"] / total if total else float("nan"),
                     "memory_bytes": r.get("memory_bytes", 0.0),
                     "memory_gib": r.get("memory_bytes", 0.0) / 2**30})
    return pd.DataFrame(rows, columns=STAGE_COLUMNS)


def stage_costs(plan) -> list:
    """One StageCost per stage, per micro-batch. Rows may carry ``forward_s`` /
    ``backward_input_s`` / ``backward_weight_s``; otherwise a stage's compute over m micro-batches
    is split 1:1:1 into forward, input-gradient and weight-gradient work (the FLOPs ratio)."""
    m = int((plan.pipeline or {}).get("microbatches", 1)) or 1
    out = []
    for r in _stages(plan):
        if "forward_s" in r:
            out.append(StageCost(r["forward_s"], r["backward_input_s"], r.get("backward_weight_s", 0.0)))
        else:
            third = r["compute_s"] / m / 3.0
            out.append(StageCost(third, third, third))
    return out


def simulate_pipeline(plan, p2p_s: float | None = None):
    """hyper_parallel's SimResult for the plan's schedule (a one-rank, one-stage run without pp)."""
    pipe = plan.pipeline if plan.pipeline and int(plan.pipeline.get("pp", 1)) > 1 else None
    if pipe is None:   # one stage: its micro-batches of gradient accumulation back to back
        m = int((plan.pipeline or {}).get("microbatches", 1)) or 1
        return simulate(schedule_facts("1F1B").ir(1, m), stage_costs(plan), 0.0)
    p, m = int(pipe["pp"]), int(pipe.get("microbatches", 1))
    # the plan's own stages per rank: an interleaved plan with virtual_stages=3 has 3p stages
    schedule = schedule_facts(pipe.get("schedule", "1F1B")).ir(p, m, int(pipe.get("virtual_stages", 1)))
    costs = stage_costs(plan)
    if p2p_s is None:
        p2p_s = float(pipe.get("p2p_s", 0.0))
    return simulate(schedule, costs, p2p_s)
