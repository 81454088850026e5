"""The registry: every parallelism this project plans, applies and verifies, in application order.

Adding a parallelism: write its entry (a ``Parallelism`` subclass in its own file of this package,
with the runtime calls it makes) and add one line here; its plan section, schema, consistency
checks and place in the runners follow from the entry. See docs/adding_a_parallelism.md.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from autoplan.parallelisms.base import Parallelism
from autoplan.parallelisms.context import ContextParallelism
from autoplan.parallelisms.data import DataParallel, HybridShardedDataParallel
from autoplan.parallelisms.expert import ExpertParallelism
from autoplan.parallelisms.pipeline import PipelineParallel
from autoplan.parallelisms.precision import Precision
from autoplan.parallelisms.recompute import Recompute
from autoplan.parallelisms.tensor import TensorParallel
from hyper_parallel.parallel_dims import mesh_roles

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


# -- one training step on this rank: what both runners and verify's dry runs do ------------------
def batch_shards(plan) -> int:
    """Ways the global batch's rows are split over the ranks (data parallel x ep, where ep shards
    the batch): a rank's micro-batch is the global batch over this."""
    return math.prod(p.batch_ways(plan) for p in PARALLELISMS)


def _mesh_place(plan, p: Parallelism) -> int:
    """Where the outermost mesh dimension of ``p`` sits in the plan's mesh (after every dimension
    when it has none): the order batch shares are taken in, outer dimensions first, so a rank's
    rows are those of its coordinate read row-major over the mesh."""
    names = list(plan.mesh["names"])
    roles = mesh_roles(names)
    return min((names.index(roles[r]) for r in p.roles if r in roles), default=len(names))


def local_batch(plan, applied: dict, inputs: torch.Tensor, targets: torch.Tensor, who: str):
    """This rank's share of a global batch: each parallelism's split (rows, then sequence chunks)
    in the mesh's order. ``applied``: what the entries' apply steps left (``ApplyTarget.state``)."""
    for p in sorted(PARALLELISMS, key=lambda q: _mesh_place(plan, q)):
        inputs, targets = p.share_batch(applied, inputs, targets, who)
    return inputs, targets


def step_loss(applied: dict, loss_fn: Callable | None, who: str) -> Callable | None:
    """The loss a step runs: the one a parallelism needs (at most one does), else ``loss_fn``
    (None: the runner's default)."""
    for p in PARALLELISMS:
        own = p.step_loss(applied, loss_fn, who)
        if own is not None:
            return own
    return loss_fn


def after_backward(applied: dict, optimizer) -> bool:
    """Every parallelism's gradient work after the step's last backward, in registry order;
    True when one of them stepped the optimizer itself."""
    stepped = False
    for p in PARALLELISMS:
        stepped = p.after_backward(applied, optimizer) or stepped
    return stepped


def stage_kwargs(applied: dict, root: nn.Module, inputs: torch.Tensor) -> dict:
    """The keywords parallelisms add to every pipeline stage's step (passed whole to each micro-batch)."""
    out: dict = {}
    for p in PARALLELISMS:
        out.update(p.stage_kwargs(applied, root, inputs) or {})
    return out


def stage_kwarg_keys(applied: dict, root: nn.Module) -> tuple[str, ...]:
    """The names :func:`stage_kwargs` will return, for the schedule's no-split specs."""
    return tuple(k for p in PARALLELISMS for k in p.stage_kwarg_keys(applied, root))
