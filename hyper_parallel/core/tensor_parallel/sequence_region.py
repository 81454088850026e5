"""Enter and leave a tensor-parallel region from a sequence-sharded stream (Megatron's SP pair).

A unit split over tp on a replicated stream is entered with Megatron's f (identity forward,
all-reduce of the input gradient) and left with g (all-reduce of the partial output). On a
sequence-sharded stream the same unit is entered by gathering the sequence (its backward
reduce-scatters the partial input gradients: each rank's channels contribute to every token)
and left by reduce-scattering the partial output onto the sequence (its backward gathers the
output gradient). Same bytes as the all-reduces, split into halves that also shard the stream.

Used where a unit's own style owns its forward (a Mamba mixer: its scan needs the whole
sequence, so the gathered region is the unit itself).
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.expert_parallel.dispatch import CopyToTP, ReduceFromTP


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


class GatherSequenceIn(torch.autograd.Function):
    """All-gather of the sequence shards on ``dim`` in forward; reduce-scatter (sum) of the
    partial gradient in backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _wait(funcol.all_gather_single(x.contiguous(), gather_dim=dim, group=group))

    @staticmethod
    def backward(ctx, grad):
        return _wait(funcol.reduce_scatter_single(grad.contiguous(), "sum", scatter_dim=ctx.dim, group=ctx.group)), None, None


class ReduceScatterSequenceOut(torch.autograd.Function):
    """Reduce-scatter (sum) of a partial output onto sequence shards on ``dim`` in forward;
    all-gather of the shards' gradients in backward."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _wait(funcol.reduce_scatter_single(x.contiguous(), "sum", scatter_dim=dim, group=group))

    @staticmethod
    def backward(ctx, grad):
        return _wait(funcol.all_gather_single(grad.contiguous(), gather_dim=ctx.dim, group=ctx.group)), None, None


def region_in(x: torch.Tensor, group, sequence_dim: int | None) -> torch.Tensor:
    """Enter a tp region: f on a replicated stream, the sequence gathered on a sharded one. A
    DTensor stream (a sequence-parallel norm's output) is taken as its local shard, laid out as
    the region expects first."""
    if isinstance(x, DTensor):
        want = Replicate() if sequence_dim is None else Shard(sequence_dim)
        x = x.redistribute(x.device_mesh, (want,)).to_local()
    return CopyToTP.apply(x, group) if sequence_dim is None else GatherSequenceIn.apply(x, sequence_dim, group)


def region_out(x: torch.Tensor, group, sequence_dim: int | None) -> torch.Tensor:
    """Leave a tp region: g on a replicated stream, reduce-scattered onto the sequence on a sharded one."""
    return ReduceFromTP.apply(x, group) if sequence_dim is None else ReduceScatterSequenceOut.apply(x, sequence_dim,
                                                                                                   group)
