"""The registry: every parallelism this project plans, applies and verifies, in application order.

Adding a parallelism: write its entry (a ``Parallelism`` subclass in its own file of this package,
with the runtime calls it makes) and add one line here; its plan section, schema, consistency
checks and place in the runners follow from the entry. See docs/adding_a_parallelism.md.
"""
from __future__ import annotations

from autoplan.parallelisms.base import Parallelism
from autoplan.parallelisms.context import ContextParallelism
from autoplan.parallelisms.data import DataParallel, HybridShardedDataParallel
from autoplan.parallelisms.expert import ExpertParallelism
from autoplan.parallelisms.pipeline import PipelineParallel
from autoplan.parallelisms.precision import Precision
from autoplan.parallelisms.recompute import Recompute
from autoplan.parallelisms.tensor import TensorParallel

# application order: PP around the rest (it cuts the model between apply_to_model and
# apply_to_roots), then TP -> (CP) -> AC -> FSDP/HSDP, as torchtitan applies them
PARALLELISMS: tuple[Parallelism, ...] = tuple(sorted((
    PipelineParallel(),
    Precision(),
    TensorParallel(),
    ContextParallelism(),
    ExpertParallelism(),
    Recompute(),
    DataParallel(),
    HybridShardedDataParallel(),
), key=lambda p: p.order))

_BY_NAME = {p.name: p for p in PARALLELISMS}


def parallelism(name: str) -> Parallelism:
    """The registry entry ``name`` ("tp", "cp", "dp", "hsdp", "pp", "ac")."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no parallelism {name!r}; registered: {sorted(_BY_NAME)}") from None


def parallel_schema() -> dict:
    """JSON schema of a plan's ``parallel`` field: one section per entry."""
    return {"type": "object", "required": [p.name for p in PARALLELISMS if not p.optional], "additionalProperties": False,
            "properties": {p.name: p.schema for p in PARALLELISMS}}


def default_sections() -> dict:
    """Every entry's section for a plan that uses none of them."""
    return {p.name: p.default() for p in PARALLELISMS}


def traffic_owners(plan) -> dict[str, str]:
    """{mesh dimension: the parallelism whose collectives run on it} for the plan's active entries:
    verify names the owner of every row and refuses traffic on a dimension no active parallelism
    uses."""
    return {dim: p.name for p in PARALLELISMS for dim in p.traffic_dims(plan)}


def apply_to_model(plan, target) -> None:
    for p in PARALLELISMS:
        p.apply_to_model(plan, target)


def apply_to_roots(plan, target) -> None:
    for p in PARALLELISMS:
        p.apply_to_roots(plan, target)
