"""Measure what autograd keeps for backward: bytes of distinct storages saved by a forward.

This is the ground truth the activation model (:mod:`cost_models.activations`) is checked
against, and it also works at full model scale without memory: run the forward on fake tensors
(:func:`cost_models.ops.fake_cpu`) and the same hooks count what a real run would keep.
Storages are counted once however many saved tensors view them; parameters (and any tensor in
``exclude``) are left out: they are model state, not activations. DTensors count their local
shard, so under tensor parallelism the result is per rank.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _storage_key(t) -> int:
    """Identity of a tensor's storage that also works for fake tensors (whose data_ptr is 0)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(_local(t).untyped_storage()).cdata


@contextlib.contextmanager
def _module_scope(model):
    """Track the innermost running submodule of ``model`` (by qualified name)."""
    stack: list[str] = []
    handles = []
    if model is not None:
        for name, mod in model.named_modules():
            handles.append(mod.register_forward_pre_hook(lambda m, a, n=name: stack.append(n)))
            handles.append(mod.register_forward_hook(lambda m, a, o, n=name: (stack.pop(), None)[1]))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


REPLICATED = "<replicated>"


def saved_bytes_by_module(fn: Callable[[], Any], model=None, exclude: Iterable = (),
                          replicated: Iterable = ()) -> tuple[dict[str, int], Any]:
    """({module name: bytes of distinct storages it saved first}, fn's result) for one call of ``fn``.

    Without ``model`` everything is attributed to ``""``. Storages of ``replicated`` tensors and
    of the model's buffers (e.g. a RoPE table, identical on every rank whatever the plan) go to
    the key ``"<replicated>"``.
    """
    import torch

    skip = {_storage_key(t) for t in exclude}
    shared = {_storage_key(t) for t in replicated}
    if model is not None:
        skip |= {_storage_key(p) for p in model.parameters()}
        shared |= {_storage_key(b) for b in model.buffers()}
    seen: set[int] = set()
    per: dict[str, int] = {}
    with _module_scope(model) as stack:
        def pack(t):
            key = _storage_key(t)
            if key not in skip and key not in seen:
                seen.add(key)
                where = REPLICATED if key in shared else (stack[-1] if stack else "")
                per[where] = per.get(where, 0) + _local(t).untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
    return per, out


def saved_storage_bytes(fn: Callable[[], Any], exclude: Iterable = ()) -> tuple[int, Any]:
    """(bytes of distinct saved storages, fn's result) for one call of ``fn`` under grad mode."""
    per, out = saved_bytes_by_module(fn, None, exclude)
    return sum(per.values()), out
