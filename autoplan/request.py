"""PlanRequest: what a caller asks of a plan, checked once at the public boundary and passed down whole.

Why one object: a planning call has many knobs (batch, dtype, hardware, memory limit, constraints,
what the search may try, whether units may stay replicated, how the step is compiled ...). Passed one
by one, each knob ran through every layer as its own parameter and every new one touched a dozen
signatures. The public entry points (``autoplan``, ``plan_cluster``, ``plan_hsdp``,
``plan_context``) keep their friendly keywords, check them here -- a typed error naming the
argument, the value and what is valid, before anything is captured -- and hand the searches one
frozen request. Derived requests (the mesh plan of the cluster search's winner) are made with
:meth:`PlanRequest.replace`, never by editing one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch

from autoplan import arguments as A
from autoplan.errors import InvalidArgumentError
from hyper_parallel.core.pipeline_parallel import SCHEDULE_NAMES


@dataclass(frozen=True)
class SearchSpace:
    """What the cluster search may try, and how long it may look."""

    schedules: tuple[str, ...] = tuple(SCHEDULE_NAMES)
    microbatch_sizes: tuple[int, ...] = (1, 2, 4)
    virtual_stages: tuple[int, ...] = (2,)
    alternatives: int = 10          # runners-up written into the plan
    max_simulations: int = 400      # pipeline simulations before the search stops refining
    time_budget_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("schedules", "microbatch_sizes", "virtual_stages"):
            object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True)
class PlanRequest:
    """Everything a plan is asked to satisfy, independent of the model and the mesh.

    ``None`` means "the planner chooses" for the tri-state choices (``fsdp``,
    ``activation_checkpointing``, ``sequence_parallel``) and "the hardware's" for ``hardware``,
    ``dtype`` and ``memory_limit``. ``precision`` is what the Linears train in (``arguments.PRECISIONS``:
    "bf16" the model's own dtype, "auto" float8 where it pays, "fp8-<recipe>" float8 wherever it
    can run); ``overlap`` says what the plan is priced as overlapping ("none" or "async_tp")."""

    batch: tuple[int, int] | None = None       # (global batch in sequences, sequence length)
    inputs: Any = None                         # example inputs of one rank, instead of batch (mesh plans)
    hardware: str | None = None                # hardware profile name (None: the mesh's)
    dtype: torch.dtype | None = None
    memory_limit: float | None = None          # bytes per rank
    fsdp: bool | None = None
    allow_replicated_units: bool = True
    activation_checkpointing: bool | None = None
    sequence_parallel: bool | None = None
    constraints: Mapping[str, Any] = field(default_factory=dict)   # plan_cluster's: dp, pp, tp, schedule, ...
    devices_per_node: int | None = None
    compile: str = "none"                      # cost_models.fusion's compile modes
    precision: str = "bf16"
    overlap: str = "none"                      # arguments.OVERLAPS: "async_tp" prices fused SP collectives
    search: SearchSpace = field(default_factory=SearchSpace)

    def __post_init__(self) -> None:
        if self.batch is not None:
            object.__setattr__(self, "batch", (int(self.batch[0]), int(self.batch[1])))
        object.__setattr__(self, "constraints", MappingProxyType(dict(self.constraints or {})))

    @property
    def expert_parallel(self) -> bool | None:
        """True: experts split by the ep dimension only; False: ep is data parallel with replicated
        experts; None: priced (``constraints['expert_parallel']``)."""
        return self.constraints.get("expert_parallel")

    def replace(self, **changes: Any) -> "PlanRequest":
        """A new request with ``changes`` (the same checks as the dataclass's own fields)."""
        return dataclasses.replace(self, **changes)

    # ---- built from a public entry point's keywords, every one checked -------------------------
    @classmethod
    def for_mesh(cls, who: str, *, hardware: str | None, **keywords: Any) -> "PlanRequest":
        """The request of a plan on a given mesh (``autoplan(model, mesh, ...)``): batch or example
        inputs, FSDP on unless refused; the mesh fixes the degrees, so the one constraint is
        ``expert_parallel`` (True: experts split by ep only; False: ep is data parallel; None: priced)."""
        fsdp = keywords.pop("fsdp", None)
        experts = A.optional_bool(keywords.pop("expert_parallel", None), "expert_parallel", who)
        return cls(batch=A.check_batch(keywords.pop("batch", None), who, required=False),
                   inputs=keywords.pop("inputs", None), hardware=hardware,
                   fsdp=True if fsdp is None else A.optional_bool(fsdp, "fsdp", who),
                   constraints={} if experts is None else {"expert_parallel": experts},
                   **_mesh_common(who, keywords, hardware))

    @classmethod
    def for_devices(cls, who: str, devices: int, **keywords: Any) -> "PlanRequest":
        """The request of a plan for a device count (``plan_cluster`` and its presets): the
        constraints checked against the devices and the batch, ``fsdp`` and
        ``activation_checkpointing`` folded into them, the search space checked."""
        batch = A.check_batch(keywords.pop("batch", None), who)
        hardware = A.check_hardware(keywords.pop("hardware", None), who) or "h100_sxm"
        dpn = check_devices_per_node(keywords.pop("devices_per_node", None), devices, who)
        fsdp = A.optional_bool(keywords.pop("fsdp", None), "fsdp", who)
        constraints = keywords.pop("constraints", None)
        space = _search_space(who, keywords)
        common = _common(who, keywords)
        constraints = A.check_constraints(constraints, devices, batch, who, fsdp=fsdp,
                                          activation_checkpointing=common["activation_checkpointing"])
        if "precision" in constraints:   # the constraint and the keyword are one setting
            stated = constraints.pop("precision")
            if common["precision"] is not None and stated != common["precision"]:
                raise InvalidArgumentError(f"{who}: precision={common['precision']!r} contradicts "
                                           f"constraints['precision']={stated!r}")
            common["precision"] = stated
        common["precision"] = A.check_precision_on(common["precision"] or "bf16", hardware, who)
        return cls(batch=batch, hardware=hardware, devices_per_node=dpn, constraints=constraints, search=space,
                   **common)


def _precision(value: Any, who: str) -> str | None:
    return None if value is None else A.check_precision(value, who)


def _mesh_common(who: str, keywords: dict, hardware: str | None) -> dict:
    common = _common(who, keywords)
    return dict(common, precision=A.check_precision_on(common["precision"] or "bf16", hardware, who))


def _common(who: str, keywords: dict) -> dict:
    """The keywords every entry point takes, checked; an unknown one is a TypeError."""
    out = {"memory_limit": A.check_memory_limit(keywords.pop("memory_limit", None), who),
           "dtype": A.check_dtype(keywords.pop("dtype", None), who),
           "allow_replicated_units": A.strict_bool(keywords.pop("allow_replicated_units", True),
                                                   "allow_replicated_units", who),
           "activation_checkpointing": A.optional_bool(keywords.pop("activation_checkpointing", None),
                                                       "activation_checkpointing", who),
           "sequence_parallel": A.optional_bool(keywords.pop("sequence_parallel", None), "sequence_parallel", who),
           "compile": A.check_compile(keywords.pop("compile", False), who),
           "overlap": A.check_overlap(keywords.pop("overlap", None), who),
           # None: not given (plan_cluster's constraints may state it; else "bf16")
           "precision": _precision(keywords.pop("precision", None), who)}
    if keywords:
        raise TypeError(f"{who}() got unexpected keyword argument(s) {sorted(keywords)}")
    return out


def _search_space(who: str, keywords: dict) -> SearchSpace:
    default = SearchSpace()
    schedules = A.check_choices(keywords.pop("schedules", default.schedules), "schedules", SCHEDULE_NAMES, who)
    sizes = [A.positive_int(b, "microbatch_sizes[]", who)
             for b in A.check_sequence(keywords.pop("microbatch_sizes", default.microbatch_sizes), "microbatch_sizes", who)]
    virtual = [A.positive_int(v, "virtual_stages[]", who)
               for v in A.check_sequence(keywords.pop("virtual_stages", default.virtual_stages), "virtual_stages", who)]
    alternatives = A.positive_int(keywords.pop("alternatives", default.alternatives), "alternatives", who)
    simulations = A.positive_int(keywords.pop("max_simulations", default.max_simulations), "max_simulations", who)
    budget = keywords.pop("time_budget_s", None)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0):
        raise InvalidArgumentError(f"{who}: time_budget_s={budget!r} must be a positive number of seconds or None")
    return SearchSpace(schedules, sizes, virtual, alternatives, simulations, budget)


def check_devices_per_node(value: Any, devices: int, who: str) -> int | None:
    """``devices_per_node`` as a positive int that fits the device count: the devices fill whole
    nodes (a multiple of it), or part of one (fewer devices than a node holds). 3 per node for 8
    devices describes no cluster: the last node would hold 2, and every node-aligned group the
    search prices (tp inside a node, HSDP's shard groups) would straddle nodes."""
    if value is None:
        return None
    per_node = A.positive_int(value, "devices_per_node", who)
    if devices > per_node and devices % per_node:
        whole = [d for d in range(1, devices + 1) if devices % d == 0]
        raise InvalidArgumentError(f"{who}: devices_per_node={per_node} does not divide devices={devices} (the last "
                                   f"node would hold {devices % per_node}); valid: a divisor of {devices} {whole}, "
                                   f"or at least {devices} (one node)")
    return per_node
