"""The loss of a context-parallel step, and the gradient reduction over cp.

One device's loss is the mean over every token of the global batch. Under cp (and dp) each rank
holds some of those tokens, so the exact loss is (sum over ranks of local sums) / (global count),
not the mean of local means (they differ once ``ignore_index`` leaves ranks with unequal counts).
``cp_cross_entropy`` returns that exact global mean as its value, and a gradient equal to this
rank's share of it times the group size, so that the *averaging* gradient reduction that follows
-- FSDP2 over the flattened dp×cp mesh (torchtitan's fold), or ``average_gradients`` over cp --
yields exactly the gradient of the global mean.

With loss parallel (vocabulary-sharded logits from the tensor-parallel LM head, ``loss_parallel``
in tensor_parallel/loss.py), pass the Shard(-1) DTensor logits: the local sum is computed by the
vocabulary-parallel cross entropy (reduction "sum") and the same cp rule applies on top; call it,
and ``backward()``, inside ``loss_parallel()`` as that module requires. The two compose because
loss parallel reduces over tp (vocabulary) and this over cp/dp (tokens): different mesh dims.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hyper_parallel.errors import LayoutError


def _group(mesh_or_group):
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim != 1:
            raise LayoutError(f"cp loss: expected a 1-D mesh (cp, or dp×cp flattened), got {mesh_or_group!r}")
        return mesh_or_group.get_group()
    return mesh_or_group


def cp_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, *, ignore_index: int = -100) -> torch.Tensor:
    """Cross entropy whose value is the mean over every non-ignored token of the batch split over
    ``group`` (a 1-D mesh or process group: cp, or the flattened dp×cp), and whose gradient is
    this rank's share × group size (see the module docstring)."""
    group = _group(group)
    flat_logits = logits.flatten(0, -2)
    local_sum = F.cross_entropy(flat_logits, target.flatten(), ignore_index=ignore_index, reduction="sum")
    if isinstance(local_sum, DTensor):   # loss parallel: replicated over tp after its own reductions
        local_sum = local_sum.to_local()
    local_count = (target != ignore_index).sum().to(torch.float64)
    totals = torch.stack([local_sum.detach().to(torch.float64), local_count])
    dist.all_reduce(totals, group=group)
    global_sum, global_count = totals[0], totals[1].clamp_min(1.0)
    size = dist.get_world_size(group)
    share = local_sum * (size / global_count).to(local_sum.dtype)
    value = (global_sum / global_count).to(local_sum.dtype)
    return share + (value - share).detach()    # value: the global mean; gradient: the scaled share


@torch.no_grad()
def average_gradients(model: nn.Module, mesh: DeviceMesh) -> None:
    """Average every gradient of ``model`` over the 1-D ``mesh`` (cp ranks hold the same parameters).
    Not needed when FSDP2 shards the model over a mesh that includes cp: its reduce-scatter does it."""
    group = _group(mesh)
    size = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, group=group)
        g.div_(size)
