"""Import hand-written plans (torchtitan, HF ``base_model_tp_plan``) so they are costed like ours.

A hand-written plan is only comparable with the planner's answer when the same cost model
prices it, so every import ends in ``autoplan(model, mesh, styles=...)``: the result is a
normal Plan with predictions, collectives, memory and decisions, ready for ``diff`` and
``compare_plans``. The parsers accept the data as published (torchtitan's placements written
as ``"Shard(1)"``, variants keyed by a condition such as ``loss_parallel=True``; HF's style
strings, keys relative to the base model) and refuse what they cannot express with a typed
error naming the entry.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch.nn as nn

from autoplan.api import autoplan
from autoplan.errors import AutoplanError
from hyper_parallel import style_from_dict
from hyper_parallel.core.tensor_parallel import match_modules
from hyper_parallel.errors import StyleSpecError

# HF ParallelInterface names (v4 and v5) -> our style dicts
_HF_TO_STYLE = {
    "colwise": {"style": "ColwiseParallel", "args": {}},
    "rowwise": {"style": "RowwiseParallel", "args": {}},
    "colwise_rep": {"style": "ColwiseParallel", "args": {"output_layouts": "Replicate()"}},
    "colwise_gather_output": {"style": "ColwiseParallel", "args": {"output_layouts": "Replicate()"}},
    "rowwise_rep": {"style": "RowwiseParallel", "args": {"input_layouts": "Replicate()"}},
    "rowwise_split_input": {"style": "RowwiseParallel", "args": {"input_layouts": "Replicate()"}},
    "embedding_rowwise": {"style": "RowwiseParallel", "args": {"input_layouts": "Replicate()"}},
    "sequence_parallel": {"style": "SequenceParallel", "args": {}},
}
_HF_SKIP = {"replicate"}  # HF's default for unmatched parameters: nothing to apply


class PlanImportError(AutoplanError, ValueError):
    """A hand-written plan entry that has no equivalent style."""


def _pick_variant(value: Any, loss_parallel: bool, version: str | None = None) -> Any:
    """Published plans key variants by a condition ({"loss_parallel=True (default)": ..., ...}
    or {"v4.x": ..., "v5": ...}); choose the one that applies."""
    if not isinstance(value, dict):
        return value
    want = f"loss_parallel={loss_parallel}"
    for key, v in value.items():
        if key.startswith(want):
            return v
    if version is not None:
        for key, v in value.items():
            if key.startswith(version):
                return v
    raise PlanImportError(f"cannot choose among variants {sorted(value)} (loss_parallel={loss_parallel}, "
                          f"version={version})")


def _arity(model: nn.Module | None, pattern: str) -> int | None:
    """Positional inputs of the first module ``pattern`` matches (None if unknown)."""
    if model is None:
        return None
    matches = match_modules(model, pattern)
    if not matches:
        return None
    params = inspect.signature(matches[0][1].forward).parameters.values()
    return sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def styles_from_expert(tp_plan: dict[str, Any], *, model: nn.Module | None = None, loss_parallel: bool = True,
                       prefix: str = "") -> dict[str, dict[str, Any]]:
    """Style dicts from a published plan of ``{"style": ..., "args": ...}`` entries (torchtitan).

    Variants are resolved by ``loss_parallel``; PrepareModuleInput layouts are cut or padded to
    the module's forward (torchtitan's arity changed with its Attention signature over time).
    """
    out = {}
    for pattern, entry in tp_plan.items():
        if not isinstance(entry, dict) or "style" not in entry:
            raise PlanImportError(f"import: entry {pattern!r} is not a {{'style', 'args'}} dict: {entry!r}")
        args = {k: _pick_variant(v, loss_parallel) for k, v in entry.get("args", {}).items()}
        full = prefix + pattern
        n = _arity(model, full)
        for key in ("input_layouts", "desired_input_layouts"):
            if isinstance(args.get(key), list) and n is not None:
                vals = list(args[key])[:n]
                args[key] = vals + [None] * (n - len(vals))
        spec = {"style": entry["style"], "args": args}
        try:
            out[full] = style_from_dict(spec).to_dict()  # canonical: default arguments dropped
        except StyleSpecError as e:
            raise PlanImportError(f"import: entry {pattern!r}: {e}") from None
    return out


def styles_from_hf(tp_plan: dict[str, Any], *, prefix: str = "model.", version: str = "v5",
                   keep_prefixed: tuple[str, ...] = ("lm_head",)) -> dict[str, dict[str, Any]]:
    """Style dicts from HF ``tp_plan`` strings (``base_model_tp_plan`` keys are relative to the
    base model, so ``prefix`` is prepended, except for the head entries in ``keep_prefixed``)."""
    out = {}
    for pattern, name in tp_plan.items():
        name = _pick_variant(name, True, version)
        if name in _HF_SKIP:
            continue
        if name not in _HF_TO_STYLE:
            raise PlanImportError(f"import: HF style {name!r} for {pattern!r} has no hyper_parallel equivalent; "
                                  f"known: {sorted(_HF_TO_STYLE)}")
        full = pattern if pattern.split(".")[0] in keep_prefixed else prefix + pattern
        out[full] = {"style": _HF_TO_STYLE[name]["style"], "args": dict(_HF_TO_STYLE[name]["args"])}
    return out


def import_plan(model: nn.Module, mesh, styles: dict, *, name: str | None = None, **autoplan_kwargs):
    """Price ``styles`` on ``model`` and ``mesh`` with the planner's cost model; returns a Plan
    whose ``model["plan_name"]`` records where it came from."""
    plan = autoplan(model, mesh, styles=styles, **autoplan_kwargs)
    return plan.replace(model=dict(plan.model, plan_name=name)) if name else plan


def load_reference(key: str, path: str | Path | None = None) -> dict:
    """One entry of an expert-plans JSON file (default: shared/reference/expert_plans.json)."""
    if path is None:
        here = Path(__file__).resolve()
        candidates = [p / "shared" / "reference" / "expert_plans.json" for p in here.parents]
        candidates.append(Path("/work/shared/reference/expert_plans.json"))
        path = next((c for c in candidates if c.exists()), None)
        if path is None:
            raise PlanImportError("import: expert_plans.json not found; pass path=")
    data = json.loads(Path(path).read_text())
    if key not in data:
        raise PlanImportError(f"import: {key!r} not in {path}; keys: {sorted(data)}")
    return data[key]


def import_torchtitan(model: nn.Module, mesh, *, loss_parallel: bool = True, tp_plan: dict | None = None,
                      path: str | Path | None = None, **autoplan_kwargs):
    """The torchtitan Llama-3 plan (``expert_plans.json["torchtitan/llama3"]["tp_plan"]`` unless
    ``tp_plan`` is given) on a torchtitan-named model (the repo Llama), priced as a Plan."""
    data = tp_plan if tp_plan is not None else load_reference("torchtitan/llama3", path)["tp_plan"]
    styles = styles_from_expert(data, model=model, loss_parallel=loss_parallel)
    return import_plan(model, mesh, styles, name="torchtitan" + ("" if loss_parallel else "_no_loss_parallel"),
                       **autoplan_kwargs)


def import_hf_tp_plan(model: nn.Module, mesh, tp_plan: dict | None = None, *, version: str = "v5",
                      path: str | Path | None = None, **autoplan_kwargs):
    """An HF ``base_model_tp_plan`` (default: HF Llama's, from expert_plans.json) on an HF model."""
    data = tp_plan if tp_plan is not None else load_reference("hf/llama", path)["tp_plan"]
    prefix = (getattr(model, "base_model_prefix", "") or "")
    prefix = prefix + "." if prefix and hasattr(model, prefix) else ""
    styles = styles_from_hf(data, prefix=prefix, version=version)
    return import_plan(model, mesh, styles, name=f"hf_tp_plan_{version}", **autoplan_kwargs)
