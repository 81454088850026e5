"""DTensor's process-wide sharding caches, emptied whenever the set of process groups changes.

Why: DTensor caches sharding decisions keyed by specs whose meshes compare equal by ranks, shape
and names, not by process group; a mesh of another (fake, destroyed or isolated) world could then
lend its group names to a DTensor of this one. ``fake_world`` and ``isolated_world`` clear them on
entry and exit; code that destroys a process group itself (a test's world of one) does too.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def clear_dtensor_caches() -> None:
    """Empty DTensor's Python and C++ sharding-propagation caches."""
    prop = DTensor._op_dispatcher.sharding_propagator
    prop.propagate_op_sharding.cache_clear()
    cached_meta = getattr(prop, "_propagate_tensor_meta_cached", None)
    if cached_meta is not None and hasattr(cached_meta, "cache_clear"):
        cached_meta.cache_clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if native is not None:  # the C++ fast path keeps its own copy
        native()
