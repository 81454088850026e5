"""``explain(plan, fqn_or_unit)``: the chosen style for a module, and why each alternative lost.

The planner records, per unit, every candidate strategy with its predicted compute,
communication and memory (``plan.decisions[i]["options"]``). Explaining a decision is reading
those numbers back beside the chosen one: an alternative loses because it is excluded (e.g. a
divisibility), because it needs the other residual-stream layout, because it is slower (and by
how much, in compute or in communication), or because it ties on time but holds more memory.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from autoplan.errors import AutoplanError
from autoplan.parallelisms.precision import precision_lines


class UnknownModuleError(AutoplanError, KeyError):
    """explain() was given a name that is neither a unit nor a module the plan covers."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


_REL_TIE = 1e-9


@dataclass
class Explanation:
    """What the plan does for one unit or module, and the alternatives with their costs."""

    query: str
    unit: str
    strategy: str
    stream: str
    reason: str
    styles: dict[str, dict[str, Any]]
    options: Any                       # pandas DataFrame, one row per candidate
    notes: list[str] = field(default_factory=list)
    count: int = 1                     # instances of the unit (e.g. 80 identical blocks)

    @property
    def text(self) -> str:
        lines = [f"{self.query}: unit {self.unit!r} uses {self.strategy!r} (stream {self.stream}) -- {self.reason}"]
        for pattern, spec in self.styles.items():
            lines.append(f"  style {pattern}: {spec['style']} {spec['args'] or ''}".rstrip())
        if len(self.options):
            lines.append(f"  alternatives (predicted for this unit, all {self.count} instance(s) together):")
            for _, r in self.options.iterrows():
                lines.append(f"    {r['strategy']:>22s} [{r['stream']}] compute {r['compute_s'] * 1e3:9.3f} ms  "
                             f"comm {r['comm_s'] * 1e3:9.3f} ms  memory {r['memory_bytes'] / 2**30:7.2f} GiB  "
                             f"-> {r['verdict']}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text

    def _repr_markdown_(self) -> str:  # notebooks
        return "```\n" + self.text + "\n```"


# unit kinds and the module names that usually implement them (torchtitan, HF, GPT-2 naming)
_KIND_NAMES = {"attention": ("attention", "attn"), "mlp": ("mlp", "feed_forward", "ffn"),
               "norms": ("norm", "ln_"), "embedding": ("embed", "wte", "word_embeddings"),
               "head": ("lm_head", "output"), "final_norm": ("norm", "ln_f")}


def _by_name(rows: list[dict], query: str) -> dict | None:
    """The unit a module belongs to by its name, for units without styles (kept replicated)."""
    for d in rows:
        prefix, kind = d.get("block_prefix"), d["unit"].split("/")[-1]
        if prefix is not None:
            rest = query[len(prefix) + 1:] if prefix and query.startswith(prefix + ".") else None
            if rest is None or "." not in rest:
                continue
            name = rest.split(".", 1)[1]
        elif "." in query:
            continue
        else:
            name = query
        first = name.split(".")[0]
        if ("norm" in first or first.startswith("ln_")) != kind.endswith("norm" if kind == "final_norm" else "norms"):
            continue  # attention_norm / ffn_norm are norms, not attention / MLP
        if any(k in first for k in _KIND_NAMES.get(kind, (kind,))):
            return d
    return None


def _find_decision(plan, query: str) -> tuple[dict, dict[str, dict]]:
    """The decision row for a unit name ("model.layers/attention", or "attention" when unique)
    or a module FQN ("model.layers.3.self_attn.q_proj"), and the styles that apply to it."""
    rows = plan.decisions
    exact = [d for d in rows if d["unit"] == query]
    if not exact:
        exact = [d for d in rows if d["unit"].split("/")[-1] == query]
    if len(exact) == 1:
        d = exact[0]
        return d, {p: plan.styles[p] for p in d.get("modules", []) if p in plan.styles}
    hits = []
    for d in rows:
        pats = d.get("modules", [])
        own = [p for p in pats if p == query or fnmatch.fnmatchcase(query, p)]
        inside = [p for p in pats if fnmatch.fnmatchcase(query, p + ".*") or p.startswith(query + ".")]
        if own or inside:
            hits.append((0 if own else 1, d, own or inside))
    if not hits:
        d = _by_name(rows, query)
        if d is not None:  # a replicated unit has no styles to match: find it by the module's name
            return d, {}
        units = sorted(d["unit"] for d in rows)
        raise UnknownModuleError(f"explain: {query!r} is neither a unit {units} nor a module in any unit's patterns")
    hits.sort(key=lambda h: h[0])
    _, d, pats = hits[0]
    return d, {p: plan.styles[p] for p in pats if p in plan.styles}


def _verdict(opt: dict, chosen: dict, plan_stream: str) -> str:
    if opt["strategy"] == chosen["strategy"] and opt["stream"] in (chosen["stream"], "-"):
        return "chosen"
    if opt.get("excluded") and opt["strategy"] != "replicate":
        return f"excluded: {opt['excluded']}"
    t_opt, t_ch = opt["compute_s"] + opt["comm_s"], chosen["compute_s"] + chosen["comm_s"]
    if opt["stream"] not in ("-", plan_stream) and t_opt <= t_ch * (1 + _REL_TIE):
        if t_opt >= t_ch * (1 - _REL_TIE):
            return (f"same cost here, but on residual stream {opt['stream']}; the plan keeps "
                    f"{plan_stream} for the whole model")
        return (f"cheaper here by {(t_ch - t_opt) * 1e3:.3g} ms, but needs residual stream {opt['stream']}; "
                f"the plan as a whole is faster on {plan_stream} (see plan.alternatives)")
    if t_opt > t_ch * (1 + _REL_TIE):
        dc, dm = opt["compute_s"] - chosen["compute_s"], opt["comm_s"] - chosen["comm_s"]
        main = "communication" if dm >= dc else "compute"
        return (f"slower by {(t_opt - t_ch) * 1e3:.3g} ms ({t_opt / t_ch:.2f}x; more {main}: "
                f"compute {dc * 1e3:+.3g} ms, comm {dm * 1e3:+.3g} ms)")
    if opt["memory_bytes"] > chosen["memory_bytes"]:
        return f"same time, {(opt['memory_bytes'] - chosen['memory_bytes']) / 2**30:.3g} GiB more memory"
    if opt["stream"] not in ("-", plan_stream):
        return f"needs residual stream {opt['stream']} (plan uses {plan_stream})"
    return "ties (the solver kept the other)"


def explain(plan, fqn_or_unit: str) -> Explanation:
    """Chosen strategy and styles for a unit or module, each alternative's predicted cost and why it lost."""
    import pandas as pd

    d, styles = _find_decision(plan, fqn_or_unit)
    chosen = {"strategy": d["strategy"], "stream": d.get("stream", "-"), "compute_s": d["compute_s"],
              "comm_s": d["comm_s"], "memory_bytes": d["memory_bytes"]}
    rows = []
    for o in d.get("options", []):
        row = {k: o.get(k) for k in ("strategy", "stream", "compute_s", "comm_s", "memory_bytes", "reason")}
        row["total_s"] = row["compute_s"] + row["comm_s"]
        row["delta_s"] = row["total_s"] - (chosen["compute_s"] + chosen["comm_s"])
        row["verdict"] = _verdict(o, chosen, plan.stream_layout)
        rows.append(row)
    cols = ["strategy", "stream", "compute_s", "comm_s", "total_s", "delta_s", "memory_bytes", "verdict", "reason"]
    table = pd.DataFrame(rows, columns=cols).sort_values(["total_s", "memory_bytes"], kind="stable")
    notes = []
    if not rows:
        notes.append("the planner had no alternative for this unit (a fixed layout change)")
    notes += [n for n in plan.notes if n.startswith((d["unit"] + ":", f"{d.get('module', d['unit'])}:"))]
    excluded = {o["excluded"] for o in d.get("options", []) if o.get("excluded") and o["strategy"] == "replicate"}
    notes += [f"sharded strategies were not candidates: {why}" for why in sorted(excluded)
              if not any(why in n for n in notes)]
    for query in (fqn_or_unit, *styles):   # the module asked about and every module the unit styles
        notes += [n for n in precision_lines(plan, query) if n not in notes]
    return Explanation(query=fqn_or_unit, unit=d["unit"], strategy=d["strategy"], stream=d.get("stream", "-"),
                       reason=d.get("reason", ""), styles=styles, options=table.reset_index(drop=True), notes=notes,
                       count=int(d.get("count", 1)))
