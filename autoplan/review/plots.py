"""Plots a reviewer reads: pipeline timeline per rank, memory per rank by kind, communication
by collective and mesh dimension. Each returns a matplotlib Figure (Agg backend, so it works
headless and in tests); ``save_figure`` writes PNG. matplotlib is imported inside the
functions so importing autoplan never touches it.
"""
from __future__ import annotations

from pathlib import Path

from autoplan.review.stages import simulate_pipeline

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868", "BACKWARD_INPUT": "#DD8452",
           "BACKWARD_WEIGHT": "#55A868"}
_MEM_KINDS = ("params", "grads", "optimizer", "activations")


def _plt():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return Figure


def _name(plan) -> str:
    m = plan.mesh
    return str(plan.model.get("plan_name") or "x".join(f"{n}{s}" for n, s in zip(m["names"], m["shape"])))


def plot_timeline(plan=None, *, sim=None, p2p_s: float | None = None, title: str | None = None):
    """Pipeline timeline: one row per rank, a box per compute action (F/B/W) per micro-batch."""
    Figure = _plt()
    if sim is None:
        sim = simulate_pipeline(plan, p2p_s)
    tl = sim.timeline
    work = tl[~tl["kind"].astype(str).str.contains("SEND|RECV")]
    ranks = sorted(work["rank"].unique())
    multi = work["stage"].nunique() > len(ranks)   # virtual stages: name the stage too
    fig = Figure(figsize=(10, 0.6 * len(ranks) + 1.5))
    ax = fig.add_subplot()
    for _, r in work.iterrows():
        kind = str(r["kind"])
        ax.barh(r["rank"], r["end"] - r["start"], left=r["start"], color=_COLORS.get(kind, "#8172B3"),
                edgecolor="white", linewidth=0.5)
        if r["end"] - r["start"] > sim.step_time / 60:
            label = f"{kind}{r['microbatch']}" + (f"\ns{r['stage']}" if multi else "")
            ax.text((r["start"] + r["end"]) / 2, r["rank"], label, ha="center", va="center", fontsize=6,
                    color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    idle = 1 - sum(sim.busy) / (len(sim.busy) * sim.step_time) if sim.step_time else 0.0
    ax.set_title(title or f"{sim.schedule}: step {sim.step_time:.3g} s, idle {idle:.1%} (mean over ranks)")
    from matplotlib.patches import Patch

    kinds = sorted(work["kind"].astype(str).unique())
    ax.legend(handles=[Patch(color=_COLORS.get(k, "#8172B3"), label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.005, 1.0), fontsize=7)
    fig.tight_layout()
    return fig


def _rank_memory(plan) -> tuple[list[str], dict[str, list[float]]]:
    """Per-rank (or per pipeline rank) memory by kind. Without pp every rank holds the same."""
    mem = plan.predictions["memory_bytes"]
    pipe = plan.pipeline
    if pipe and int(pipe.get("pp", 1)) > 1 and pipe.get("per_stage"):
        per_rank: dict[int, float] = {}
        for s in pipe["per_stage"]:
            per_rank[s.get("rank", s.get("stage", 0))] = max(per_rank.get(s.get("rank", 0), 0.0), s["memory_bytes"])
        ranks = sorted(per_rank)
        if all(k in pipe["per_stage"][0] for k in ("memory_by_kind",)):
            by = {k: [0.0] * len(ranks) for k in _MEM_KINDS}
            for s in pipe["per_stage"]:
                for k, v in s["memory_by_kind"].items():
                    by.setdefault(k, [0.0] * len(ranks))[ranks.index(s["rank"])] += v
            return [f"pp rank {r}" for r in ranks], by
        return [f"pp rank {r}" for r in ranks], {"total": [per_rank[r] for r in ranks]}
    kinds = [k for k in _MEM_KINDS if k in mem] + [k for k in mem if k not in _MEM_KINDS and k != "total"]
    return ["every rank"], {k: [float(mem[k])] for k in kinds}


def plot_memory(plans, names: list[str] | None = None, *, limit_bytes: float | None = None):
    """Stacked bars of memory per rank by kind (params, grads, optimizer, activations), one
    group per plan (or per pipeline rank), with the device capacity as a line when given."""
    Figure = _plt()
    plans = plans if isinstance(plans, (list, tuple)) else [plans]
    names = names or [_name(p) for p in plans]
    labels, stacks = [], {}
    for name, plan in zip(names, plans):
        rl, by = _rank_memory(plan)
        for i, lab in enumerate(rl):
            labels.append(f"{name}\n{lab}" if len(plans) > 1 or len(rl) > 1 else name)
            idx = len(labels) - 1
            for k, vals in by.items():
                stacks.setdefault(k, {})[idx] = vals[i]
    fig = Figure(figsize=(max(5, 1.2 * len(labels) + 2), 4))
    ax = fig.add_subplot()
    bottom = [0.0] * len(labels)
    for kind, vals in stacks.items():
        heights = [vals.get(i, 0.0) / 2**30 for i in range(len(labels))]
        ax.bar(range(len(labels)), heights, bottom=bottom, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights)]
    if limit_bytes:
        ax.axhline(limit_bytes / 2**30, color="red", linestyle="--", label="capacity")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("GiB per rank")
    ax.set_title("predicted memory per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def communication_table(plan):
    """Total bytes and calls per (collective, mesh dimension), summed over phases."""
    import pandas as pd

    rows = plan.predictions.get("collectives", [])
    frame = pd.DataFrame(rows, columns=["kind", "mesh_dim", "phase", "bytes", "count"])
    frame["total_bytes"] = frame["bytes"].astype(float) * frame["count"]
    return frame.groupby(["kind", "mesh_dim"], as_index=False).agg(total_bytes=("total_bytes", "sum"),
                                                                   calls=("count", "sum"))


def plot_communication(plan):
    """Bars of bytes moved per step by each collective kind, one colour per mesh dimension."""
    Figure = _plt()
    table = communication_table(plan)
    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    kinds = sorted(table["kind"].unique())
    dims = sorted(table["mesh_dim"].unique())
    width = 0.8 / max(len(dims), 1)
    for j, dim in enumerate(dims):
        sub = table[table["mesh_dim"] == dim].set_index("kind")
        vals = [float(sub["total_bytes"].get(k, 0.0)) / 2**30 for k in kinds]
        ax.bar([i + j * width for i in range(len(kinds))], vals, width, label=f"mesh dim {dim}")
    ax.set_xticks([i + width * (len(dims) - 1) / 2 for i in range(len(kinds))], kinds)
    ax.set_ylabel("GiB per step per rank (sum of collective sizes)")
    ax.set_title(f"communication by collective: {_name(plan)}")
    if dims:
        ax.legend()
    fig.tight_layout()
    return fig


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as PNG (the format follows the suffix) and return the path."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
