"""Plan: the planner's answer as reviewable data.

A Plan holds the mesh it was made for, the hyper_parallel styles per module pattern, the
per-unit decisions with their costs and reasons, predictions (step time split into compute and
communication, per-rank memory by kind, the collectives with kind, mesh dim, phase, count and
bytes), ranked alternatives and the solver's report. ``to_json`` is deterministic (sorted keys,
no wall-clock times unless asked), so identical inputs give identical files; ``from_json``
validates against the schema and only looks style names up in a fixed registry.

Schema 2: counts and byte figures are exact integers and floats are written in full (shortest
repr that reads back to the same double), so a plan read back from its file equals the plan
written, field by field, and verifies the same. (Schema 1 rounded every number to 9 significant
digits: a 2,861,912,064-byte prediction came back as 2,861,912,060.)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplan.errors import InvalidArgumentError, PlanSchemaError
from autoplan.plan.runner import apply_plan
from autoplan.plan.schema import SCHEMA_VERSION, validate_plan_data
from hyper_parallel import style_from_dict


def _plain(value: Any) -> Any:
    """JSON's own types (tuples become lists, dicts are copied), so ``to_dict`` equals what
    ``from_json(to_json())`` gives back and never aliases the plan's fields."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _reject_constant(name: str):
    raise PlanSchemaError(f"plan JSON contains {name}: every number in a plan must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 reads as inf
        _reject_constant(text)
    return value


@dataclass
class Plan:
    mesh: dict[str, Any]                       # ParallelDims.to_dict()
    tp_dim: str | None
    dp_dim: str | None
    styles: dict[str, dict[str, Any]]          # pattern -> style dict (hyper_parallel registry)
    stream_layout: str                         # "R" or "S" (sequence parallel)
    loss_parallel: bool
    fsdp: dict[str, Any]
    decisions: list[dict[str, Any]]
    predictions: dict[str, Any]
    alternatives: list[dict[str, Any]]
    solver: dict[str, Any]
    model: dict[str, Any]
    batch: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    activation_checkpointing: bool = False
    pipeline: dict[str, Any] | None = None
    # selective recomputation: {"mode": "selective", "modules": [patterns of the attention
    # modules whose own ops are recomputed]}; empty: none, or full when activation_checkpointing
    recompute: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)   # wall-clock; not in JSON unless asked
    schema_version: int = SCHEMA_VERSION

    # ------------------------------------------------------------------ data
    def to_dict(self, timing: bool = False) -> dict[str, Any]:
        data = {
            "schema_version": self.schema_version, "model": self.model, "mesh": self.mesh, "batch": self.batch,
            "tp_dim": self.tp_dim, "dp_dim": self.dp_dim, "styles": self.styles,
            "stream_layout": self.stream_layout, "loss_parallel": self.loss_parallel, "fsdp": self.fsdp,
            "activation_checkpointing": self.activation_checkpointing,
            "pipeline": self.pipeline, "decisions": self.decisions, "predictions": self.predictions,
            "alternatives": self.alternatives, "solver": self.solver, "notes": self.notes,
        }
        if self.recompute:
            data["recompute"] = self.recompute
        if timing:
            data["timing"] = self.timing
        return _plain(data)

    def to_json(self, path: str | Path | None = None, *, timing: bool = False) -> str:
        text = json.dumps(self.to_dict(timing), indent=1, sort_keys=True, allow_nan=False) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        validate_plan_data(data)
        data = _plain(data)  # the plan owns its data: later edits of ``data`` do not reach it
        kw = {k: data[k] for k in ("mesh", "tp_dim", "dp_dim", "styles", "stream_layout", "loss_parallel", "fsdp",
                                   "decisions", "predictions", "alternatives", "solver", "model", "batch")}
        return cls(**kw, notes=list(data.get("notes", [])), pipeline=data.get("pipeline"),
                   activation_checkpointing=bool(data.get("activation_checkpointing", False)),
                   recompute=dict(data.get("recompute") or {}),
                   timing=dict(data.get("timing", {})), schema_version=data["schema_version"])

    @classmethod
    def from_json(cls, source: str | Path) -> "Plan":
        """Load from a path or a JSON string; never executes anything in it. Anything that is not
        a valid plan raises PlanSchemaError naming the field."""
        if not isinstance(source, (str, Path)):
            raise PlanSchemaError(f"Plan.from_json: expected a path or a JSON string, got {type(source).__name__}")
        text = str(source)
        if not text.lstrip().startswith("{"):
            try:
                text = Path(source).read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise PlanSchemaError(f"plan file {source} is not UTF-8 JSON (corrupted?): {e}") from None
            except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
                raise PlanSchemaError(f"plan file {source}: {e}") from None
        try:
            data = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
        except json.JSONDecodeError as e:
            raise PlanSchemaError(f"plan JSON is corrupted or truncated: {e}") from None
        except RecursionError:
            raise PlanSchemaError("plan JSON is nested too deeply to be a plan") from None
        return cls.from_dict(data)

    # ------------------------------------------------------------------ use
    def tp_plan(self):
        """{pattern: ParallelStyle} for hyper_parallel.parallelize_module."""
        return {k: style_from_dict(v) for k, v in self.styles.items()}

    def apply(self, model, mesh, **runner_kwargs):
        """Parallelize ``model`` on ``mesh`` (a DeviceMesh with this plan's dim names) and return
        a :class:`~autoplan.plan.runner.Runner` whose ``step(batch)`` trains."""
        import torch.nn as nn
        from torch.distributed.device_mesh import DeviceMesh

        if not isinstance(model, nn.Module):
            raise InvalidArgumentError(f"plan.apply: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(mesh, DeviceMesh):
            raise InvalidArgumentError(f"plan.apply: mesh must be a DeviceMesh named {tuple(self.mesh['names'])} of "
                                       f"shape {tuple(self.mesh['shape'])}, got {type(mesh).__name__}")
        return apply_plan(self, model, mesh, **runner_kwargs)

    @property
    def recompute_mode(self) -> str:
        """``none`` | ``selective`` | ``full`` (full: ``activation_checkpointing``)."""
        return self.recompute.get("mode") or ("full" if self.activation_checkpointing else "none")

    @property
    def step_time(self) -> float:
        return float(self.predictions["step_s"])

    def summary(self):
        """pandas DataFrame, one row per decision (unit): strategy, styles, costs, memory."""
        import pandas as pd

        return pd.DataFrame(self.decisions)

    def collectives(self):
        import pandas as pd

        return pd.DataFrame(self.predictions.get("collectives", []))

    def __repr__(self) -> str:
        m = self.mesh
        return (f"Plan(mesh={dict(zip(m['names'], m['shape']))}, stream={self.stream_layout}, "
                f"loss_parallel={self.loss_parallel}, {len(self.styles)} styles, "
                f"step≈{self.predictions.get('step_s', float('nan')):.4g}s)")

    # ---- review (issue 8): thin delegations to autoplan.review (exports, explain, diff, plots)
    # review imports the planner (importers price plans through autoplan(), which builds Plans), so
    # Plan reaches it only when one of these is called: a real cycle if imported at the top.
    def explain(self, fqn_or_unit: str):
        """Chosen style for a unit or module, each alternative's predicted cost and why it lost."""
        from autoplan.review import explain  # lazy: review is a layer above Plan

        return explain(self, fqn_or_unit)

    def diff(self, other: "Plan"):
        """DataFrame of what differs from ``other`` (styles, decisions, predictions, collectives)."""
        from autoplan.review import diff  # lazy: review is a layer above Plan

        return diff(self, other)

    def module_table(self):
        """DataFrame, one row per module pattern: style, layouts, and its unit's predicted costs."""
        from autoplan.review import module_table  # lazy: review is a layer above Plan

        return module_table(self)

    def stage_table(self):
        """DataFrame, one row per pipeline stage (one row without pipeline parallelism)."""
        from autoplan.review import stage_table  # lazy: review is a layer above Plan

        return stage_table(self)

    def to_torch(self, model=None):
        """{pattern: torch.distributed.tensor.parallel style} for torch's parallelize_module."""
        from autoplan.review import to_torch  # lazy: review is a layer above Plan

        return to_torch(self, model)

    def to_hf_tp_plan(self, model=None, **kwargs):
        """HF tp_plan strings where expressible, and the entries that are not (with reasons)."""
        from autoplan.review import to_hf_tp_plan  # lazy: review is a layer above Plan

        return to_hf_tp_plan(self, model, **kwargs)

    def to_python(self) -> str:
        """A readable snippet reproducing this parallelization with hyper_parallel."""
        from autoplan.review import to_python  # lazy: review is a layer above Plan

        return to_python(self)

    def plot_memory(self, **kwargs):
        """matplotlib Figure: memory per rank stacked by kind."""
        from autoplan.review import plot_memory  # lazy: review is a layer above Plan

        return plot_memory(self, **kwargs)

    def plot_communication(self):
        """matplotlib Figure: bytes per collective kind and mesh dimension."""
        from autoplan.review import plot_communication  # lazy: review is a layer above Plan

        return plot_communication(self)

    def plot_timeline(self, **kwargs):
        """matplotlib Figure: the pipeline schedule per rank from hyper_parallel's simulator."""
        from autoplan.review import plot_timeline  # lazy: review is a layer above Plan

        return plot_timeline(self, **kwargs)
