"""Measure what autograd keeps for backward: bytes of distinct storages saved by a forward.

This is the ground truth the activation model (:mod:`cost_models.activations`) is checked
against. Storages are counted once however many saved tensors view them, and parameters (and any
tensor passed in ``exclude``) are left out: they are model state, not activations.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable


def saved_storage_bytes(fn: Callable[[], Any], exclude: Iterable = ()) -> tuple[int, Any]:
    """(bytes of distinct saved storages, fn's result) for one call of ``fn`` under grad mode."""
    import torch

    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in seen:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out
