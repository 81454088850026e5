"""``plan_report(plans)``: one self-contained HTML page that shows a whole plan, or compares several.

A reviewer of a plan file in a pull request needs one thing to open that shows everything the
plan decided and why: the summary, every unit's decision beside each alternative's predicted
cost and verdict, the styles per module, the pipeline stages and their simulated timeline,
memory per rank, the predicted collectives, the priced alternatives, notes and what was
refused. The page is built from the same review functions the notebooks and CLI use
(compare, explain, stages, modules, plots) and is one file: figures are inline PNG (data
URLs), the style sheet is inline, and there is no script, so it opens offline from disk, in a
CI artifact or attached to a review.
"""
from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from autoplan.errors import AutoplanError
from autoplan.review.compare import compare_plans
from autoplan.review.diff import diff
from autoplan.review.explain import explain
from autoplan.review.modules import module_table
from autoplan.review.plots import communication_table, plot_communication, plot_memory, plot_timeline
from autoplan.review.stages import stage_table
from cost_models.errors import UnknownHardwareError
from cost_models.hardware import load_hardware

REPORT_DPI = 90
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0 auto; max-width: 1200px;
       padding: 1em 2em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 2px solid #4C72B0; padding-bottom: .2em; margin-top: 2em; }
h3 { margin-top: 1.5em; }
table.data { border-collapse: collapse; font-size: 12px; margin: .5em 0 1em; }
table.data th, table.data td { border: 1px solid #ccc; padding: 2px 6px; text-align: right; vertical-align: top; }
table.data th { background: #eef2f8; }
table.data td:first-child, table.data th:first-child { text-align: left; }
img.figure { display: block; max-width: 100%; height: auto; margin: .5em 0; border: 1px solid #eee; }
details { margin: .3em 0 .6em; } summary { cursor: pointer; }
.note { background: #fffbe6; border-left: 4px solid #e6b800; padding: .3em .6em; margin: .3em 0; }
.refused { background: #fdecea; border-left: 4px solid #d9534f; padding: .3em .6em; margin: .3em 0; }
nav a { margin-right: 1em; } code { background: #f4f4f4; padding: 0 3px; }
"""


def _esc(value: Any) -> str:
    return html.escape(str(value))


def _table(frame, table_id: str, *, index: bool = False, floats: str = "{:.4g}") -> str:
    """A DataFrame as an HTML table (escaped), with an id the tests and readers can find."""
    return frame.to_html(index=index, border=0, classes="data", table_id=table_id, na_rep="-",
                         float_format=lambda v: floats.format(v), escape=True)


def _figure(fig, figure_id: str, alt: str) -> str:
    data = base64.b64encode(fig.png(dpi=REPORT_DPI)).decode("ascii")
    width, height = (int(round(v * REPORT_DPI)) for v in fig.get_size_inches())
    return (f'<img class="figure" id="{figure_id}" alt="{_esc(alt)}" width="{width}" height="{height}" '
            f'src="data:image/png;base64,{data}">')


def _kv(rows: dict[str, Any], table_id: str) -> str:
    body = "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows.items())
    return f'<table class="data" id="{table_id}">{body}</table>'


def _cell(value: Any) -> Any:
    """A table cell: a mesh {"dp": 32, "pp": 4} as "dp32 x pp4", a list as "a, b"; the rest as is."""
    if isinstance(value, dict):
        return " x ".join(f"{k}{v}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value))
    return value


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _summary(plan, row: dict[str, Any]) -> dict[str, Any]:
    model = plan.model
    out = {"model": model.get("source") or model.get("type", "-"),
           "parameters": f"{model['num_parameters']:,}" if model.get("num_parameters") else "-",
           "batch": f"{plan.batch.get('global_batch')} x {plan.batch.get('seq_len')} tokens, "
                    f"{plan.batch.get('dtype', '-')}"}
    out.update({k: _fmt(v) for k, v in row.items()})
    out["solver"] = ", ".join(f"{k} {v}" for k, v in plan.solver.items())
    return out


def _refusals(plan):
    """Options the planner could not use (excluded, with the reason), one row per unit and option."""
    import pandas as pd

    rows = [{"unit": d["unit"], "strategy": o["strategy"], "stream": o.get("stream", "-"), "why": o["excluded"]}
            for d in plan.decisions for o in d.get("options", []) if o.get("excluded")]
    return pd.DataFrame(rows, columns=["unit", "strategy", "stream", "why"])


def _decisions(plan, pid: str) -> str:
    cols = ["unit", "count", "strategy", "stream", "compute_s", "comm_s", "memory_bytes", "reason"]
    summary = plan.summary()
    parts = [_table(summary[[c for c in cols if c in summary.columns]], f"{pid}-decisions")]
    for i, d in enumerate(plan.decisions):
        e = explain(plan, d["unit"])
        opts = e.options.drop(columns=["reason"]) if "reason" in e.options else e.options
        parts.append(f"<details><summary><code>{_esc(d['unit'])}</code>: {_esc(e.strategy)} "
                     f"[{_esc(e.stream)}] -- {len(e.options)} alternative(s)</summary>"
                     f"{_table(opts, f'{pid}-options-{i}')}"
                     + "".join(f'<div class="note">{_esc(n)}</div>' for n in e.notes) + "</details>")
    return "".join(parts)


def _pipeline(plan, pid: str, name: str) -> str:
    pipe = plan.pipeline or {}
    pp = int(pipe.get("pp", 1))
    parts = [_table(stage_table(plan).drop(columns=["memory_bytes"]), f"{pid}-stages")]
    if pp > 1:
        facts = {k: pipe[k] for k in ("pp", "schedule", "virtual_stages", "microbatches", "microbatch_size",
                                      "bubble_fraction", "cuts") if k in pipe}
        parts.insert(0, _kv({k: _fmt(v) for k, v in facts.items()}, f"{pid}-pipeline"))
    else:
        parts.insert(0, "<p>No pipeline parallelism: every rank holds the whole model (one stage"
                        + (f", {pipe['microbatches']} micro-batches of gradient accumulation"
                           if int(pipe.get("microbatches", 1)) > 1 else "") + ").</p>")
    parts.append(_figure(plot_timeline(plan), f"{pid}-timeline", f"simulated step timeline of {name}"))
    return "".join(parts)


def _collectives(plan, pid: str, name: str) -> str:
    import pandas as pd

    parts = [_table(communication_table(plan), f"{pid}-comm")]
    if plan.predictions.get("collectives"):
        parts.append(_figure(plot_communication(plan), f"{pid}-comm-figure", f"communication of {name}"))
    rows = pd.DataFrame(plan.predictions.get("collectives", []),
                        columns=["kind", "mesh_dim", "phase", "bytes", "count"])
    parts.append(f"<details><summary>every predicted collective ({len(rows)} rows)</summary>"
                 f"{_table(rows, f'{pid}-collectives', floats='{:.6g}')}</details>")
    per_rank = (plan.pipeline or {}).get("rank_collectives") or []
    if len(per_rank) > 1:
        frames = [pd.DataFrame(r, columns=["kind", "mesh_dim", "phase", "bytes", "count"]).assign(pp_rank=i)
                  for i, r in enumerate(per_rank)]
        by = pd.concat(frames).assign(total_bytes=lambda f: f["bytes"].astype(float) * f["count"])
        by = by.groupby(["pp_rank", "kind", "mesh_dim"], as_index=False).agg(total_bytes=("total_bytes", "sum"),
                                                                            calls=("count", "sum"))
        parts.append(f"<h4>per pipeline rank</h4>{_table(by, f'{pid}-rank-collectives')}")
    return "".join(parts)


def _plan_section(plan, name: str, row: dict[str, Any], i: int) -> str:
    import pandas as pd

    pid = f"plan{i}"
    limit = _capacity(plan)
    mem = {k: f"{v / 2**30:.2f} GiB" for k, v in plan.predictions.get("memory_bytes", {}).items()}
    refused = _refusals(plan)
    alts = pd.DataFrame(plan.alternatives).map(_cell)
    first = [c for c in ("name", "mesh", "schedule", "step_s", "memory_bytes") if c in alts.columns]
    alts = alts[first + [c for c in alts.columns if c not in first]]
    sections = [
        f'<section id="{pid}"><h2>{_esc(name)}</h2><p><code>{_esc(repr(plan))}</code></p>',
        "<h3>Summary</h3>", _kv(_summary(plan, row), f"{pid}-summary"),
        "<h3>Memory per rank</h3>", _kv(mem, f"{pid}-memory"),
        _figure(plot_memory(plan, [name], limit_bytes=limit), f"{pid}-memory-figure", f"memory per rank of {name}"),
        "<h3>Pipeline stages and timeline</h3>", _pipeline(plan, pid, name),
        "<h3>Decisions per unit, and every alternative's cost</h3>", _decisions(plan, pid),
        "<h3>Styles per module</h3>", _table(module_table(plan), f"{pid}-styles"),
        "<h3>Precision per module</h3>", _precision(plan, pid),
        "<h3>Predicted collectives</h3>", _collectives(plan, pid, name),
        "<h3>Alternatives priced</h3>",
        _table(alts, f"{pid}-alternatives") if len(alts) else "<p>none recorded</p>",
        "<h3>Notes and refusals</h3>",
        "".join(f'<div class="note">{_esc(n)}</div>' for n in plan.notes) or "<p>no notes</p>",
        (f"<p>{len(refused)} option(s) could not be used:</p>"
         + "".join(f'<div class="refused"><code>{_esc(r.unit)}</code> {_esc(r.strategy)} [{_esc(r.stream)}]: '
                   f"{_esc(r.why)}</div>" for r in refused.itertuples())) if len(refused)
        else "<p>no option was refused</p>",
        "</section>",
    ]
    return "".join(sections)


def _precision(plan, pid: str) -> str:
    """Each float8 pattern with its recipe and each kept one with its reason (the plan's
    ``parallel.precision``); a plan without float8 says so."""
    import pandas as pd

    section = (plan.parallel or {}).get("precision")
    if not section:
        return "<p>every Linear in the model's dtype (no float8)</p>"
    rows = [{"modules": p, "precision": f"float8 ({r})", "why": ""} for p, r in section["modules"].items()]
    rows += [{"modules": p, "precision": "high", "why": why} for p, why in section.get("kept", {}).items()]
    gather = "<p>FSDP gathers the tensorwise weights in float8</p>" if section.get("fsdp_float8_all_gather") else ""
    return _table(pd.DataFrame(rows), f"{pid}-precision") + gather


def _capacity(plan) -> float | None:
    """The usable device memory of the plan's datasheet profile (the line on the memory plot);
    none for the measured ``cpu`` profile (measuring the host is not a report's business) or a
    profile this install lacks."""
    name = plan.mesh.get("hardware")
    if not name or str(name).lower() == "cpu":
        return None
    try:
        return float(load_hardware(name).usable_memory())
    except UnknownHardwareError:
        return None


def _comparison(plans, names: list[str], table) -> str:
    parts = ['<section id="comparison"><h2>Comparison</h2>',
             _table(table.T.rename_axis(index=None, columns="plan"), "comparison-table", index=True),
             _figure(plot_memory(plans, names, limit_bytes=_capacity(plans[0])), "comparison-memory",
                     "memory per rank of every plan"),
             _figure(plot_timeline(plans, names=names), "comparison-timeline", "timelines of every plan")]
    for i, (name, plan) in enumerate(zip(names[1:], plans[1:]), start=1):
        d = diff(plans[0], plan)
        parts.append(f"<h3>{_esc(names[0])} vs {_esc(name)}</h3>"
                     + ("<p>identical</p>" if d.empty else
                        f"<details><summary>{len(d)} difference(s)</summary>{_table(d, f'diff-{i}')}</details>"))
    parts.append("</section>")
    return "".join(parts)


def plan_report(plans, names: list[str] | None = None, *, title: str | None = None) -> str:
    """The HTML page (a string) for one plan or several (then with a comparison first)."""
    plans = list(plans) if isinstance(plans, (list, tuple)) else [plans]
    if not plans:
        raise AutoplanError("plan_report: no plans given")
    table = compare_plans(plans, names)
    names = [str(n) for n in table.index]
    title = title or ("plan " + names[0] if len(plans) == 1 else f"{len(plans)} plans: " + ", ".join(names))
    nav = ('<a href="#comparison">comparison</a>' if len(plans) > 1 else "") + "".join(
        f'<a href="#plan{i}">{_esc(n)}</a>' for i, n in enumerate(names))
    body = [f"<h1>{_esc(title)}</h1>",
            "<p>Written by <code>autoplan report</code>: predictions of autoplan's cost model; "
            "nothing here was measured.</p>",
            f"<nav>{nav}</nav>"]
    if len(plans) > 1:
        body.append(_comparison(plans, names, table))
    rows = table.to_dict("index")
    body += [_plan_section(p, n, rows[n], i) for i, (p, n) in enumerate(zip(plans, names))]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{_esc(title)}</title><style>{_CSS}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def write_report(plans, path: str | Path, names: list[str] | None = None, *, title: str | None = None) -> Path:
    """Write :func:`plan_report` to ``path`` and return the path."""
    path = Path(path)
    path.write_text(plan_report(plans, names, title=title), encoding="utf-8")
    return path
