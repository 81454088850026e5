"""parallelize_module: apply a plan of {FQN pattern: style} to a model, all or nothing.

The key "" names the root module itself. Patterns are matched atom by atom with fnmatch (``layers.*.attention.wq`` matches
``layers.0.attention.wq`` but ``layers.*`` does not match ``layers.0.attention``); nested dicts
are joined with dots. A pattern that matches no module is skipped with a warning, as torch does
(``strict=True`` makes it an error, naming close FQNs -- what autoplan's runners use); a module
matched by several patterns takes the most specific one (fewest wildcard atoms:
``layers.0.attention`` overrides ``layers.*.attention``), and equally specific rivals are an error.
Without ``device_mesh`` the mesh of the enclosing ``with mesh:`` context is used, as in torch. Every style checks its module before anything changes; if applying still fails, all changes
are rolled back, so the model is left exactly as it was.

A module that is already parallelized -- styled by an earlier call of ours, holding DTensor
parameters, or carrying torch's tensor-parallel hooks -- is refused before anything changes:
two styles on one module (Colwise then Rowwise, or the same plan twice) compose layouts nobody
asked for and only fail later, in forward, with an unrelated message.
"""
from __future__ import annotations

import difflib
import logging
import warnings
from typing import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, _mesh_resources
from torch.distributed.tensor import DTensor

from hyper_parallel.core.fqn_pattern import fqn_matches, wildcards
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle, check_mesh_1d
from hyper_parallel.errors import AlreadyParallelizedError, MeshError, PlanPatternError, PlanTypeError

log = logging.getLogger(__name__)

PlanLike = ParallelStyle | Mapping[str, "PlanLike"]


def flatten_plan(plan: PlanLike, prefix: str = "") -> dict[str, ParallelStyle]:
    """{"layers.*": {"attention.wq": s}} -> {"layers.*.attention.wq": s}."""
    if isinstance(plan, ParallelStyle):
        return {prefix: plan}
    if not isinstance(plan, Mapping):
        raise PlanTypeError(
            f"plan entry {prefix or '<root>'!r}: expected a ParallelStyle or a dict, got {type(plan).__name__}"
        )
    flat: dict[str, ParallelStyle] = {}
    for key, value in plan.items():
        if key == "" and not prefix:  # "" names the module the plan is applied to
            flat[""] = value if isinstance(value, ParallelStyle) else flatten_plan(value).get("")
            if not isinstance(flat[""], ParallelStyle):
                raise PlanPatternError("plan key '' (the root module) must map to a ParallelStyle")
            continue
        if not isinstance(key, str) or not key or key.startswith(".") or key.endswith("."):
            raise PlanPatternError(f"plan key {key!r} under {prefix or '<root>'!r} is not a module pattern")
        full = f"{prefix}.{key}" if prefix else key
        for k, v in flatten_plan(value, full).items():
            if k in flat:
                raise PlanPatternError(f"plan pattern {k!r} is given twice")
            flat[k] = v
    return flat


def match_modules(module: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """(fqn, submodule) pairs whose FQN matches ``pattern`` atom by atom."""
    if pattern == "":
        return [("", module)]
    return [(fqn, sub) for fqn, sub in module.named_modules() if fqn and fqn_matches(pattern, fqn)]


_MARK = "_hp_parallelized"  # set on every module a parallelize_module call styled (rolled back on failure)


def _hook_owner(hook) -> str:
    fn = getattr(hook, "func", hook)  # functools.partial
    return f"{getattr(fn, '__module__', '') or ''}.{getattr(fn, '__qualname__', '')}"


def already_parallelized(module: nn.Module) -> str | None:
    """Why ``module`` counts as parallelized already (None if it does not): our mark, a DTensor
    parameter of its own, or a forward hook installed by torch.distributed.tensor."""
    style = getattr(module, _MARK, None)
    if style:
        return f"an earlier parallelize_module call applied {style}"
    for name, p in module.named_parameters(recurse=False):
        if isinstance(p, DTensor):
            return f"its parameter {name!r} is already a DTensor with placements {tuple(p.placements)}"
    hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
    for h in hooks:
        owner = _hook_owner(h)
        if owner.startswith("torch.distributed.tensor"):
            return f"it carries a hook from torch's tensor parallelism ({owner})"
    return None


def resolve_mesh(device_mesh: DeviceMesh | None, mesh_dim: str | None) -> DeviceMesh:
    """The 1-D mesh to shard on: ``device_mesh`` (or the one of the enclosing ``with mesh:``
    context) itself, or its named dimension ``mesh_dim``."""
    if device_mesh is None:
        try:
            device_mesh = _mesh_resources.get_current_mesh()
        except RuntimeError:
            raise MeshError("parallelize_module: no device_mesh given and no DeviceMesh context is active; pass "
                            "device_mesh= or call it inside `with mesh:`") from None
    if not isinstance(device_mesh, DeviceMesh):
        raise MeshError(f"parallelize_module: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    if mesh_dim is not None:
        names = device_mesh.mesh_dim_names or ()
        if mesh_dim not in names:
            raise MeshError(f"parallelize_module: mesh_dim={mesh_dim!r} is not one of the mesh's dims {names}")
        if device_mesh.ndim == 1:
            return device_mesh
        return device_mesh[mesh_dim]
    check_mesh_1d(device_mesh, "parallelize_module")
    return device_mesh


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: PlanLike | None = None, *, mesh_dim: str | None = None,
                       src_data_rank: int | None = 0, strict: bool = False) -> nn.Module:
    """Apply ``parallelize_plan`` to ``module`` on a 1-D mesh (or the ``mesh_dim`` of an n-D mesh).

    ``device_mesh``: None takes the mesh of the enclosing ``with mesh:`` context (torch's rule).
    ``src_data_rank``: the rank whose initial values are scattered to the shards (None: every
    rank keeps its own values, which must then be identical -- no communication at apply).
    ``strict``: a pattern matching no module, or no plan at all, is an error instead of torch's
    warning. Returns ``module`` (modified in place).
    """
    mesh = resolve_mesh(device_mesh, mesh_dim)
    if parallelize_plan is None:
        if strict:
            raise PlanPatternError(f"parallelize_module: no plan given for {type(module).__name__} (strict=True)")
        warnings.warn(f"parallelize_module: no plan given; {type(module).__name__} left unchanged", stacklevel=2)
        return module
    flat = flatten_plan(parallelize_plan)
    fqns = [f for f, _ in module.named_modules()]

    chosen: dict[str, tuple[str, nn.Module, ParallelStyle]] = {}
    for pattern, style in flat.items():
        matches = match_modules(module, pattern)
        if not matches:
            close = difflib.get_close_matches(pattern, fqns, n=3, cutoff=0.5)
            hint = f"; did you mean {close}?" if close else ""
            message = f"plan pattern {pattern!r} matches no module of {type(module).__name__}{hint}"
            if strict:
                raise PlanPatternError(message)
            warnings.warn(f"{message}; skipping this entry (strict=True makes it an error)", stacklevel=2)
            continue
        for fqn, sub in matches:
            if fqn in chosen:
                other = chosen[fqn][0]
                if wildcards(pattern) == wildcards(other):
                    raise PlanPatternError(
                        f"module {fqn!r} is matched by both {other!r} and {pattern!r}; give it one style"
                    )
                if wildcards(pattern) > wildcards(other):
                    continue  # the more specific pattern already owns this module
            chosen[fqn] = (pattern, sub, style)
    assignments = [(fqn, sub, style) for fqn, (_, sub, style) in chosen.items()]

    for fqn, sub, style in assignments:  # phase 1: check everything, change nothing
        why = already_parallelized(sub)
        if why:
            raise AlreadyParallelizedError(
                f"module {fqn or '<root>'!r} ({type(sub).__name__}) is already parallelized: {why}; refusing to apply "
                f"{style!r} on top. Parallelize a fresh model once (one style per module, before fully_shard)")
        style.check_module(sub, mesh, fqn)

    record = ApplyRecord(src_data_rank)
    try:
        for fqn, sub, style in assignments:  # phase 2: apply, recording every change
            style.apply(sub, mesh, record, fqn)
            record.add_flag(sub, _MARK, repr(style))
        moved = record.repoint_aliases(module)   # unstyled holders of a replaced parameter follow it
        if moved:
            log.debug("parallelize_module: re-pointed aliases of replaced parameters: %s", moved)
    except BaseException:
        record.rollback()
        raise
    log.debug("parallelize_module: applied %d styles on a mesh of size %d", len(assignments), mesh.size())
    return module
