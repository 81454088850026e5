"""Placements as plain strings ("Shard(1)", "Replicate()", "Partial(sum)") and back.

Plans are data: a style's layouts must survive JSON without pickling or eval. Parsing is a
strict regular expression, so a plan file can never execute code.
"""
from __future__ import annotations

import re
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from hyper_parallel.errors import StyleSpecError

_SHARD = re.compile(r"^Shard\((-?\d+)\)$")
_PARTIAL = re.compile(r"^Partial\((sum|avg|max|min)?\)$")
_REDUCE_OPS = {"sum", "avg", "max", "min"}
MAX_TENSOR_DIMS = 8  # Shard(d) in a plan: -8 <= d < 8 (weights and activations have far fewer dims)


def placement_to_str(p: Placement | None) -> str | None:
    """Canonical text of a placement; None stays None (meaning 'leave this tensor alone')."""
    if p is None:
        return None
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    raise StyleSpecError(f"placement {p!r} of type {type(p).__name__} has no text form")


def placement_from_str(text: str | None, *, where: str = "placement") -> Placement | None:
    """Inverse of placement_to_str; raises StyleSpecError naming ``where`` on anything else."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise StyleSpecError(f"{where}: expected a placement string like 'Shard(1)', got {text!r}")
    s = text.strip()
    if s == "Replicate()":
        return Replicate()
    m = _SHARD.match(s)
    if m:
        dim = int(m.group(1))
        if not -MAX_TENSOR_DIMS <= dim < MAX_TENSOR_DIMS:
            raise StyleSpecError(f"{where}: {text!r} shards a dimension no tensor of a plan has "
                                 f"(valid: Shard(d) with {-MAX_TENSOR_DIMS} <= d < {MAX_TENSOR_DIMS})")
        return Shard(dim)
    m = _PARTIAL.match(s)
    if m:
        return Partial(m.group(1) or "sum")
    raise StyleSpecError(
        f"{where}: {text!r} is not a placement (expected Shard(d), Replicate() or Partial(op))"
    )


def layouts_to_data(value: Any) -> Any:
    """Placement / tuple of placements / dict name->placement -> JSON-able data."""
    if isinstance(value, dict):
        return {k: placement_to_str(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [placement_to_str(v) for v in value]
    return placement_to_str(value)


def layouts_from_data(value: Any, *, where: str) -> Any:
    """Inverse of layouts_to_data (lists become tuples)."""
    if isinstance(value, dict):
        return {k: placement_from_str(v, where=f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return tuple(placement_from_str(v, where=f"{where}[{i}]") for i, v in enumerate(value))
    return placement_from_str(value, where=where)
