"""Plots a reviewer reads: pipeline timeline per rank, memory per rank by kind, communication
by collective and mesh dimension.

Each returns a :class:`PlanFigure`: a matplotlib Figure that needs no backend and no pyplot (it
saves headless, in tests and on servers) and shows itself in notebooks. A bare Figure made
without pyplot displays as ``<Figure size ...>`` text in Jupyter unless pyplot's inline backend
happens to be active; PlanFigure carries its own ``_repr_png_``, so IPython (Jupyter, VS Code)
renders it as an image under any backend. The process-wide matplotlib backend is never changed.
``save_figure`` writes PNG/SVG; ``PlanFigure.png()`` / ``.svg()`` give the bytes/text for HTML.
matplotlib is imported when a plot is made, so importing autoplan never touches it.
"""
from __future__ import annotations

import io
from pathlib import Path

from autoplan.review.stages import simulate_pipeline

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#DD8452", "W": "#55A868", "BACKWARD_INPUT": "#DD8452",
           "BACKWARD_WEIGHT": "#55A868"}
_MEM_KINDS = ("params", "grads", "optimizer", "activations")
NOTEBOOK_DPI = 72     # what a notebook embeds: readable on screen, ~20-40 KB per figure
_FIGURE_CLASS = None


def figure_class():
    """The PlanFigure class (a matplotlib Figure subclass), made on first use."""
    global _FIGURE_CLASS
    if _FIGURE_CLASS is None:
        from matplotlib.figure import Figure

        class PlanFigure(Figure):
            """A matplotlib Figure that IPython displays as PNG and that renders without pyplot."""

            def png(self, dpi: int = NOTEBOOK_DPI) -> bytes:
                buf = io.BytesIO()
                self.savefig(buf, format="png", dpi=dpi)
                return buf.getvalue()

            def svg(self) -> str:
                buf = io.StringIO()
                self.savefig(buf, format="svg")
                text = buf.getvalue()
                return text[text.index("<svg"):]   # no XML prolog: embeddable in HTML

            def _repr_png_(self) -> bytes:   # IPython's image/png formatter
                return self.png()

        PlanFigure.__qualname__ = "PlanFigure"   # picklable as autoplan.review.plots.PlanFigure
        globals()["PlanFigure"] = _FIGURE_CLASS = PlanFigure
    return _FIGURE_CLASS


def new_figure(**kwargs):
    """A PlanFigure (``figsize=`` etc. as for matplotlib's Figure): for plots of one's own tables
    that should show in a notebook and save headless like the ones here."""
    return figure_class()(**kwargs)


def _name(plan) -> str:
    m = plan.mesh
    return str(plan.model.get("plan_name") or "x".join(f"{n}{s}" for n, s in zip(m["names"], m["shape"])))


def _draw_timeline(ax, sim, title: str | None, min_label_s: float | None = None) -> None:
    tl = sim.timeline
    work = tl[~tl["kind"].astype(str).str.contains("SEND|RECV")]
    ranks = sorted(work["rank"].unique())
    multi = work["stage"].nunique() > len(ranks)   # virtual stages: name the stage too
    labelled = len(work) <= 400                    # past that the labels are unreadable anyway
    for (rank, kind), rows in work.groupby(["rank", work["kind"].astype(str)]):
        spans = list(zip(rows["start"], rows["end"] - rows["start"]))
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=_COLORS.get(kind, "#8172B3"), edgecolor="white",
                       linewidth=0.5)
    if labelled:
        for r in work.itertuples():
            if r.end - r.start > (min_label_s if min_label_s is not None else sim.step_time / 60):
                label = f"{r.kind}{r.microbatch}" + (f"\ns{r.stage}" if multi else "")
                ax.text((r.start + r.end) / 2, r.rank, label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.set_ylim(max(ranks) + 0.6, min(ranks) - 0.6)
    ax.set_xlabel("time (s)")
    idle = 1 - sum(sim.busy) / (len(sim.busy) * sim.step_time) if sim.step_time else 0.0
    ax.set_title(title or f"{sim.schedule}: simulated step {sim.step_time:.3g} s, idle {idle:.1%} (mean over ranks)",
                 fontsize=9)
    from matplotlib.patches import Patch

    kinds = sorted(work["kind"].astype(str).unique())
    ax.legend(handles=[Patch(color=_COLORS.get(k, "#8172B3"), label=k) for k in kinds], loc="upper left",
              bbox_to_anchor=(1.005, 1.0), fontsize=7)


def plot_timeline(plan=None, *, sim=None, p2p_s: float | None = None, title: str | None = None,
                  names: list[str] | None = None):
    """Pipeline timeline: one row per rank, a box per compute action (F/B/W) per micro-batch.

    ``plan`` may be a list of plans: one panel each, on a shared time axis, so schedules and
    bubbles compare at a glance (``names`` titles the panels)."""
    if isinstance(plan, (list, tuple)):
        plans = list(plan)
        names = names or [_name(p) for p in plans]
        sims = [simulate_pipeline(p, p2p_s) for p in plans]
        heights = [0.45 * len(set(s.timeline["rank"])) + 0.9 for s in sims]
        fig = new_figure(figsize=(10, sum(heights) + 0.6))
        axes = fig.subplots(len(plans), 1, sharex=True, squeeze=False,
                            gridspec_kw={"height_ratios": heights})[:, 0]
        longest = max(s.step_time for s in sims)
        for ax, name, sim in zip(axes, names, sims):
            _draw_timeline(ax, sim, f"{name} -- {sim.schedule}: simulated step {sim.step_time:.3g} s", longest / 25)
        fig.tight_layout()
        return fig
    if sim is None:
        sim = simulate_pipeline(plan, p2p_s)
    ranks = sim.timeline["rank"].nunique()
    fig = new_figure(figsize=(10, 0.6 * ranks + 1.5))
    _draw_timeline(fig.add_subplot(), sim, title)
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
    fig = new_figure(figsize=(max(5, 1.2 * len(labels) + 2), 4))
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
    table = communication_table(plan)
    fig = new_figure(figsize=(7, 4))
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
    """Write ``fig`` to ``path`` (PNG, SVG or PDF by the suffix) and return the path."""
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    return path
