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

Schema 3: decisions are stored per parallelism (``parallel.tp``, ``parallel.dp``, ``parallel.hsdp``,
``parallel.ac``, ``parallel.pp``), one section per entry of ``autoplan.parallelisms``, each with its
own schema fragment and checks, instead of fixed top-level fields; the properties ``styles``,
``tp_dim``, ``fsdp``, ``pipeline``... read and write those sections. Schema-2 files are upgraded on
load (their fields moved into the sections unchanged).
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoplan.errors import InvalidArgumentError, PlanSchemaError, PlanSealedError
from autoplan.plan.frozen import freeze, thaw
from autoplan.plan.runner import apply_plan
from autoplan.parallelisms import default_sections
from autoplan.plan.schema import SCHEMA_VERSION, upgrade_plan_data, validate_plan_data
from autoplan.review import (
    diff, explain, module_table, plot_communication, plot_memory, plot_timeline, stage_table, to_hf_tp_plan, to_python,
    to_torch,
)
from hyper_parallel import style_from_dict


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
    # one section per registered parallelism (autoplan.parallelisms): "tp" (dim, styles, stream
    # layout, loss parallel), "dp" (dim, fsdp), "hsdp", "ac" (recomputation), "pp" (pipeline)
    parallel: dict[str, Any]
    decisions: list[dict[str, Any]]
    predictions: dict[str, Any]
    alternatives: list[dict[str, Any]]
    solver: dict[str, Any]
    model: dict[str, Any]
    batch: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    timing: dict[str, float] = field(default_factory=dict)   # wall-clock; not in JSON unless asked
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        self.parallel = dict(default_sections(), **(self.parallel or {}))

    def __setattr__(self, name: str, value: Any) -> None:
        # a built plan is a value: its fields and section properties are set while it is a draft
        # (autoplan.assembler builds it) and never after; ``replace`` makes a changed copy
        if self.__dict__.get("_sealed") and name in plan_fields():
            raise PlanSealedError(f"Plan.{name}: a plan is not changed after it is built; make a changed copy with "
                                  f"plan.replace({name}=...), or build it in autoplan.assembler")
        object.__setattr__(self, name, value)

    @classmethod
    def from_fields(cls, *, mesh: dict, tp_dim: str | None = None, dp_dim: str | None = None,
                    styles: dict | None = None, stream_layout: str = "R", loss_parallel: bool = False,
                    fsdp: dict | None = None, activation_checkpointing: bool = False, **rest: Any) -> "Plan":
        """A plan from the decisions by name (what the planner decides); each lands in its section
        (recomputation beyond whole blocks and the pipeline are added by the cluster search)."""
        plan = cls(mesh=mesh, parallel={}, **rest)
        plan.tp_dim, plan.styles, plan.stream_layout, plan.loss_parallel = tp_dim, dict(styles or {}), \
            stream_layout, bool(loss_parallel)
        plan.dp_dim, plan.fsdp = dp_dim, dict(fsdp or {"enabled": False})
        plan.activation_checkpointing = bool(activation_checkpointing)
        plan.pipeline = None
        return plan

    def replace(self, **changes: Any) -> "Plan":
        """A copy of this plan with ``changes``: any field or section property by name
        (``styles=``, ``fsdp=``, ``pipeline=``, ``predictions=`` ...); an unknown name is a TypeError."""
        known = set(self.__dataclass_fields__) | {k for k, v in vars(type(self)).items() if isinstance(v, property)
                                                  and v.fset is not None}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"Plan.replace: unknown field(s) {unknown}; known: {sorted(known)}")
        new = draft(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return sealed(new)

    # ---- the sections by the names the planner and runners use ----------------------------------
    @property
    def tp_dim(self) -> str | None:
        return self.parallel["tp"]["dim"]

    @tp_dim.setter
    def tp_dim(self, value: str | None) -> None:
        self.parallel["tp"] = dict(self.parallel["tp"], dim=value)

    @property
    def styles(self) -> dict[str, dict[str, Any]]:
        """pattern -> style dict (hyper_parallel registry)."""
        return self.parallel["tp"]["styles"]

    @styles.setter
    def styles(self, value: dict) -> None:
        self.parallel["tp"] = dict(self.parallel["tp"], styles=value)

    @property
    def stream_layout(self) -> str:
        """"R" (replicated residual stream) or "S" (sequence parallel)."""
        return self.parallel["tp"]["stream_layout"]

    @stream_layout.setter
    def stream_layout(self, value: str) -> None:
        self.parallel["tp"] = dict(self.parallel["tp"], stream_layout=value)

    @property
    def loss_parallel(self) -> bool:
        return self.parallel["tp"]["loss_parallel"]

    @loss_parallel.setter
    def loss_parallel(self, value: bool) -> None:
        self.parallel["tp"] = dict(self.parallel["tp"], loss_parallel=value)

    @property
    def dp_dim(self) -> str | None:
        return self.parallel["dp"]["dim"]

    @dp_dim.setter
    def dp_dim(self, value: str | None) -> None:
        self.parallel["dp"] = dict(self.parallel["dp"], dim=value)

    @property
    def fsdp(self) -> dict[str, Any]:
        """The data-parallel decision as one dict (a copy): ``enabled``, ``dim``, ``mode``,
        ``mixed_precision``, and for HSDP ``replicate_dim``/``replicate``/``shard`` (the hsdp
        section). Assign a whole dict to change it."""
        out = dict(self.parallel["dp"]["fsdp"])
        hsdp = self.parallel.get("hsdp")
        if hsdp:
            out.update(replicate_dim=hsdp["dim"], replicate=hsdp["replicate"], shard=hsdp["shard"])
        return out

    @fsdp.setter
    def fsdp(self, value: dict) -> None:
        value = dict(value)
        rep = value.pop("replicate_dim", None)
        r, sh = value.pop("replicate", None), value.pop("shard", None)
        self.parallel["dp"] = dict(self.parallel["dp"], fsdp=value)
        self.parallel["hsdp"] = {"dim": rep, "replicate": r, "shard": sh} if rep else None

    @property
    def activation_checkpointing(self) -> bool:
        """Full recomputation of every repeated block."""
        return self.parallel["ac"]["mode"] == "full"

    @activation_checkpointing.setter
    def activation_checkpointing(self, value: bool) -> None:
        if value:
            self.parallel["ac"] = {"mode": "full"}
        elif self.parallel["ac"]["mode"] == "full":
            self.parallel["ac"] = {"mode": "none"}

    @property
    def recompute(self) -> dict[str, Any]:
        """Selective recomputation: ``{"mode": "selective", "modules": [attention patterns]}``;
        empty: none, or full (``activation_checkpointing``)."""
        ac = self.parallel["ac"]
        return dict(ac) if ac["mode"] == "selective" else {}

    @recompute.setter
    def recompute(self, value: dict) -> None:
        if value and value.get("mode", "selective") == "selective":
            self.parallel["ac"] = {"mode": "selective", "modules": list(value.get("modules", []))}
        elif self.parallel["ac"]["mode"] == "selective":
            self.parallel["ac"] = {"mode": "none"}

    @property
    def pipeline(self) -> dict[str, Any] | None:
        return self.parallel.get("pp")

    @pipeline.setter
    def pipeline(self, value: dict | None) -> None:
        self.parallel["pp"] = value

    # ------------------------------------------------------------------ data
    def to_dict(self, timing: bool = False) -> dict[str, Any]:
        data = {
            "schema_version": self.schema_version, "model": self.model, "mesh": self.mesh, "batch": self.batch,
            "parallel": self.parallel, "decisions": self.decisions, "predictions": self.predictions,
            "alternatives": self.alternatives, "solver": self.solver, "notes": self.notes,
        }
        if timing:
            data["timing"] = self.timing
        return thaw(data)

    def to_json(self, path: str | Path | None = None, *, timing: bool = False) -> str:
        text = json.dumps(self.to_dict(timing), indent=1, sort_keys=True, allow_nan=False) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, data: Any) -> "Plan":
        data = upgrade_plan_data(data)   # a schema-2 file: its fixed fields moved into sections
        validate_plan_data(data)
        data = thaw(data)  # the plan owns its data: later edits of ``data`` do not reach it
        kw = {k: data[k] for k in ("mesh", "parallel", "decisions", "predictions", "alternatives", "solver", "model",
                                   "batch")}
        return sealed(cls(**kw, notes=list(data.get("notes", [])), timing=dict(data.get("timing", {})),
                          schema_version=data["schema_version"]))

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
        experts = len(((self.parallel or {}).get("ep") or {}).get("styles") or {})
        return (f"Plan(mesh={dict(zip(m['names'], m['shape']))}, stream={self.stream_layout}, "
                f"loss_parallel={self.loss_parallel}, {len(self.styles)} styles"
                + (f" + {experts} expert-parallel" if experts else "") + ", "
                f"step≈{self.predictions.get('step_s', float('nan')):.4g}s)")

    # ---- review: thin delegations to autoplan.review (exports, explain, diff, plots), which reads
    # a plan as data and sits below it (it imports no planner)
    def explain(self, fqn_or_unit: str):
        """Chosen style for a unit or module, each alternative's predicted cost and why it lost."""
        return explain(self, fqn_or_unit)

    def diff(self, other: "Plan"):
        """DataFrame of what differs from ``other`` (styles, decisions, predictions, collectives)."""
        return diff(self, other)

    def module_table(self):
        """DataFrame, one row per module pattern: style, layouts, and its unit's predicted costs."""
        return module_table(self)

    def stage_table(self):
        """DataFrame, one row per pipeline stage (one row without pipeline parallelism)."""
        return stage_table(self)

    def to_torch(self, model=None):
        """{pattern: torch.distributed.tensor.parallel style} for torch's parallelize_module."""
        return to_torch(self, model)

    def to_hf_tp_plan(self, model=None, **kwargs):
        """HF tp_plan strings where expressible, and the entries that are not (with reasons)."""
        return to_hf_tp_plan(self, model, **kwargs)

    def to_python(self) -> str:
        """A readable snippet reproducing this parallelization with hyper_parallel."""
        return to_python(self)

    def plot_memory(self, **kwargs):
        """matplotlib Figure: memory per rank stacked by kind."""
        return plot_memory(self, **kwargs)

    def plot_communication(self):
        """matplotlib Figure: bytes per collective kind and mesh dimension."""
        return plot_communication(self)

    def plot_timeline(self, **kwargs):
        """matplotlib Figure: the pipeline schedule per rank from hyper_parallel's simulator."""
        return plot_timeline(self, **kwargs)


def plan_fields() -> frozenset[str]:
    """The names a plan is written through: its dataclass fields and its section properties."""
    return _FIELDS


def draft(plan: Plan) -> Plan:
    """An editable copy of ``plan`` (a deep copy with plain containers: the original is untouched)."""
    new = copy.copy(plan)
    new.__dict__.pop("_sealed", None)
    for name in plan.__dataclass_fields__:
        object.__setattr__(new, name, thaw(getattr(plan, name)))
    return new


def sealed(plan: Plan) -> Plan:
    """``plan``, from now on refusing any assignment to its fields and any change inside them
    (PlanSealedError): every section becomes read-only (``autoplan.plan.frozen``)."""
    for name in plan.__dataclass_fields__:
        object.__setattr__(plan, name, freeze(getattr(plan, name)))
    plan.__dict__["_sealed"] = True
    return plan


def is_sealed(plan: Plan) -> bool:
    return bool(plan.__dict__.get("_sealed"))


_FIELDS = frozenset(Plan.__dataclass_fields__) | {
    k for k, v in vars(Plan).items() if isinstance(v, property) and v.fset is not None}
