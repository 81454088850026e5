"""Replicated data parallelism for plans that choose it over FSDP: one all-reduce per step.

Each rank keeps whole (TP-sharded) parameters; after backward the local gradients are flattened
into one buffer, summed over the dp group and divided by its size. One collective of a known
size per step keeps the plan's prediction exact and the cost low on any backend (gloo has no
average reduction, hence sum then divide).
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def allreduce_gradients(params: Iterable[torch.nn.Parameter], group, world: int) -> None:
    """Average the gradients of ``params`` over ``group`` (``world`` ranks) in one all-reduce."""
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if world <= 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def unique_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters once each (tied ones counted once), in registration order."""
    seen, out = set(), []
    for p in model.parameters():
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append(p)
    return out
