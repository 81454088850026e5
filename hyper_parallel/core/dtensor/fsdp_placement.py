"""Which dimension FSDP2 shards a tensor-parallel parameter on.

FSDP2 shards every parameter on dim 0. Over a plain ``Shard(0)`` tensor-parallel parameter it
composes the two placements correctly, but over a *strided* one -- a packed projection
(``ColwiseParallel(packed=k)``: each rank its slice of each of k fused projections) -- FSDP2 keeps
``Shard(0)`` for the tensor-parallel dimension and drops the stride. Training stays right (each
rank's local data is what it should be), but the parameter's global view is not: ``full_tensor()``,
distributed checkpoints and any comparison with one device see its rows scrambled (measured on
torch 2.13, dp=2 x tp=2). Sharding such a weight on its other dimension keeps both placements
exact. A 1-D parameter strided by tensor parallelism (a packed projection's bias) has no other
dimension: FSDP must leave it alone (``fsdp_unshardable`` lists such parameters for
``ignored_params``; their gradients are then averaged over dp by the caller, one all-reduce), and
``fsdp_shard_placement`` refuses one that reaches it instead of checkpointing it scrambled.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.errors import LayoutError


def strided_dims(param: nn.Parameter) -> set[int]:
    """Dimensions a DTensor parameter is strided-sharded on (empty for any other parameter)."""
    if not isinstance(param, DTensor):
        return set()
    return {p.dim % param.ndim for p in param.placements if isinstance(p, _StridedShard)}


def _local_numel(p: nn.Parameter) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()


def fsdp_unshardable(module: nn.Module) -> list[nn.Parameter]:
    """Parameters of ``module`` FSDP2 cannot shard: strided-sharded by tensor parallelism on every
    dimension (a packed projection's bias: sharding would scramble its global view), or holding
    no element on this rank (an ep rank that owns no expert when ep does not divide the expert
    count: FSDP2's reduce-scatter rejects an empty gradient). The ranks of a dp group share every
    other mesh coordinate, so they agree on this list."""
    seen, out = set(), []
    for p in module.parameters():
        if id(p) not in seen and p.ndim and (strided_dims(p) >= set(range(p.ndim)) or not _local_numel(p)):
            seen.add(id(p))
            out.append(p)
    return out


def fsdp_shard_placement(param: nn.Parameter) -> Shard | None:
    """``shard_placement_fn`` for ``fully_shard``: dim 0 (None, FSDP2's default) unless the
    parameter is strided-sharded on dim 0, then the first other dimension."""
    strided = strided_dims(param)
    if 0 not in strided:
        return None
    free = [d for d in range(param.ndim) if d not in strided]
    if not free:
        raise LayoutError(
            f"fully_shard: a parameter of shape {tuple(param.shape)} with placements {tuple(param.placements)} is "
            f"strided-sharded by tensor parallelism on its only dimension (a packed projection's bias); FSDP2 "
            f"would scramble its global view. Pass it in ignored_params (fsdp_unshardable) and average its gradient")
    return Shard(free[0])
