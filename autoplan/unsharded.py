"""A tensor-parallel plan that leaves a model which needs sharding whole is refused, never returned.

Why: a plan is a promise that the model fits and trains on the mesh. When capture cannot trace a
model (the planner then knows only its parameter count) or no unit of a model part can be sharded,
the planner used to return a data-parallel plan with a note -- every rank holding the whole model.
For a small model that is a correct, if slow, answer; for a model that needs sharding (above
:data:`NEEDS_SHARDING_PARAMS` parameters, or whenever the request forbids replicated units) it is a
plan that cannot fit, and a note is easily missed. So such a plan becomes an
:class:`~autoplan.errors.UnshardedPlanError` that names the construct that stops sharding (the
capture failure, or the model part left whole) and what would be valid instead.

"Left whole" means: nothing sharded at all, or a model part holding :data:`WHOLE_PART_SHARE` of the
parameters or more (a decoder, a vision tower, a second stack) with no sharded unit -- a block
group whose attention and MLP are all replicated, or linear layers outside every block group.
"""
from __future__ import annotations

from typing import Mapping

from autoplan.capture.ir import ModelGraph
from autoplan.errors import UnshardedPlanError

__all__ = ["NEEDS_SHARDING_PARAMS", "WHOLE_PART_SHARE", "refuse_unsharded", "refuse_untraced", "sharding_required"]

# the stated size above which a model needs sharding: one billion parameters are 16 GB of weights,
# gradients and Adam state in mixed precision -- a fifth of an 80 GB device before any activation
NEEDS_SHARDING_PARAMS = 1_000_000_000
# a model part at least this share of the parameters is a tower or a stack, not glue (a projector)
WHOLE_PART_SHARE = 0.1
_UNIT_SLOTS = ("/attention", "/cross_attention", "/mlp", "/moe", "/mamba")


def sharding_required(num_parameters: int, allow_replicated_units: bool) -> str | None:
    """Why a model must be sharded by a tensor-parallel plan, or None when replicating it is allowed."""
    if not allow_replicated_units:
        return "allow_replicated_units=False"
    if num_parameters > NEEDS_SHARDING_PARAMS:
        return f"{num_parameters:,} parameters, above the {NEEDS_SHARDING_PARAMS:,} a replicated model may hold"
    return None


def refuse_untraced(graph: ModelGraph, model_name: str, tp: int, allow_replicated_units: bool) -> None:
    """Raise when capture could not trace a model (``graph`` is the opaque stand-in) that needs sharding
    at ``tp`` > 1: nothing in an untraced model can be planned as a unit."""
    need = sharding_required(graph.num_parameters, allow_replicated_units) if tp > 1 else None
    if need is None:
        return
    why = graph.warnings[0] if graph.warnings else f"capture could not trace {model_name}"
    raise UnshardedPlanError(
        f"autoplan: {model_name} needs sharding at tp={tp} ({need}), but {why}; nothing in it can be "
        f"tensor-parallel, so every rank would hold the whole model. Valid instead: give the model inputs "
        f"capture can run (an extra_inputs(tokens) hook or example inputs=), or plan it data-parallel "
        f"(tp=1, FSDP shards the parameters)")


def whole_parts(graph: ModelGraph, structure, chosen: Mapping, experts_by_ep: bool = False) -> list[tuple[str, int, str]]:
    """Model parts of at least :data:`WHOLE_PART_SHARE` of the parameters that ``chosen`` (slot ->
    option) leaves unsharded: (module, parameters, why). ``experts_by_ep``: the experts are split by
    an ep dimension, so a replicated ``/moe`` slot of the TP search is sharded all the same."""
    total = max(int(structure.num_parameters), 1)
    floor = WHOLE_PART_SHARE * total
    parts = []
    by_id = {g.id: g for g in graph.blocks}
    for b in structure.blocks:
        g = by_id.get(b.id)
        params = g.params_per_block * g.count if g is not None else 0
        units = [o for slot, o in chosen.items() if slot.startswith(b.id + "/") and slot.endswith(_UNIT_SLOTS)]
        if params >= floor and not any(_sharded(o, experts_by_ep) for o in units):
            why = next((o.strategy.extra.get("tp_excluded") for o in units if o.strategy.extra.get("tp_excluded")),
                       "its attention and MLP are found but every one is replicated" if units
                       else "no attention or MLP unit was found in its blocks")
            parts.append((b.prefix, params, why))
    for fqn, n in structure.outside_units:
        if n >= floor:
            parts.append((fqn, n, "linear layers outside every repeated block group, embedding and head"))
    return parts


def refuse_unsharded(graph: ModelGraph, structure, chosen: Mapping, model_name: str, tp: int,
                     allow_replicated_units: bool, why_replicated: str = "", experts_by_ep: bool = False) -> None:
    """Raise when a plan at ``tp`` > 1 for a model that needs sharding shards nothing or leaves a
    whole model part (see the module docstring) replicated. ``why_replicated``: the search's own
    reason when it chose replication (tensor parallelism did not pay)."""
    need = sharding_required(int(structure.num_parameters), allow_replicated_units) if tp > 1 else None
    if need is None:
        return
    if not any(_sharded(o, experts_by_ep) for o in chosen.values()):
        reason = why_replicated or "no unit of it has a sharded strategy"
        raise UnshardedPlanError(
            f"autoplan: {model_name} needs sharding at tp={tp} ({need}), but the plan shards nothing: {reason}. "
            f"Valid instead: another tp degree, or tp=1 (data parallel, FSDP shards the parameters)")
    parts = whole_parts(graph, structure, chosen, experts_by_ep)
    if parts:
        where, n, why = parts[0]
        raise UnshardedPlanError(
            f"autoplan: {model_name} needs sharding at tp={tp} ({need}), but the plan leaves {where} whole "
            f"({n:,} parameters, {n / max(int(structure.num_parameters), 1):.0%} of the model): {why}. "
            f"Valid instead: another tp degree, or tp=1 (data parallel, FSDP shards the parameters)")


def _sharded(option, experts_by_ep: bool = False) -> bool:
    if experts_by_ep and option.slot.endswith("/moe"):
        return True
    return option.strategy.param_shard > 1 or option.strategy.compute_shard > 1
