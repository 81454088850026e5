"""Enter and leave a tensor-parallel region from a sequence-sharded stream (Megatron's SP pair).

A unit split over tp on a replicated stream is entered with Megatron's f (identity forward,
all-reduce of the input gradient) and left with g (all-reduce of the partial output). On a
sequence-sharded stream the same unit is entered by gathering the sequence (its backward
reduce-scatters the partial input gradients: each rank's channels contribute to every token)
and left by reduce-scattering the partial output onto the sequence (its backward gathers the
output gradient). Same bytes as the all-reduces, split into halves that also shard the stream.

``region_in`` / ``region_out`` are used where a unit's own style owns its forward (a Mamba mixer
split over tp: its scan needs the whole sequence, so the gathered region is the unit itself).
``GatheredRegion`` is the style for a unit that is not split itself (or splits inside: an MoE
layer's experts) but needs the whole sequence: gather in, slice out.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn as nn
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.expert_parallel.dispatch import CopyToTP, ReduceFromTP
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle
from hyper_parallel.core.tensor_parallel.head_styles import (check_attribute_paths, check_local_attributes,
                                                             set_local_attributes)
from hyper_parallel.errors import LayoutError, StyleSpecError


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


class GatheredRegion(ParallelStyle):
    """A module computed on the whole sequence inside a sequence-sharded stream: its first input
    (the stream: a local shard on ``sequence_dim``, or a DTensor) is gathered, and the stream's
    shard is sliced out of its first output; further inputs and outputs pass untouched (an MoE
    layer's router logits, a mixer's cache). What a ``PrepareModuleInputOutput`` from ``Shard``
    to ``Replicate`` and back does, for modules that return a tuple of any length or flatten the
    tokens: an output whose leading dimension is the gathered input's tokens flattened (batch x
    sequence: Llama-4's MoE returns ``(tokens, hidden)``) is sliced as that many tokens and
    returned flattened again. Inside, the module runs replicated or splits itself over tp (an
    MoE layer's experts); either way every rank holds the same output and input gradient, so the
    slice's backward gathers the output gradient and the gather's backward takes its own slice.

    ``local_attributes``: for a module whose heads are split inside the region (JetMoE's mixture
    of attention heads: its experts and K/V projection split by heads, with their own styles), the
    head counts and widths it stores, made local as ``PrepareHeadsInput`` makes them -- the region
    is then this module's one style, doing both."""

    _args = {"sequence_dim": 1, "local_attributes": None}

    def __init__(self, *, sequence_dim: int = 1, local_attributes: list[str] | None = None):
        if type(sequence_dim) is not int or sequence_dim < 0:
            raise StyleSpecError(f"GatheredRegion: sequence_dim must be a non-negative int, got {sequence_dim!r}")
        self.sequence_dim = sequence_dim
        self.local_attributes = None if local_attributes is None else \
            check_attribute_paths(local_attributes, "GatheredRegion")

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        if mesh.ndim != 1:
            raise LayoutError(f"GatheredRegion on {fqn or '<root>'}: needs a one-dimensional tp mesh, got {mesh.ndim}-D")
        if self.local_attributes:
            check_local_attributes(module, self.local_attributes, None, mesh, f"GatheredRegion on {fqn or '<root>'}")

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        where = f"GatheredRegion on {fqn or '<root>'}"
        if self.local_attributes:
            set_local_attributes(module, self.local_attributes, None, mesh, record)
        names = [p.name for p in inspect.signature(module.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        seen: dict[str, tuple] = {}

        def pre(mod, args, kwargs):
            if args:
                args = (self._gather(args[0], mesh, where, seen),) + tuple(args[1:])
            elif names and names[0] in kwargs:
                kwargs = dict(kwargs, **{names[0]: self._gather(kwargs[names[0]], mesh, where, seen)})
            else:
                raise LayoutError(f"{where}: the stream (first input) was not passed")
            return args, kwargs

        def post(mod, inputs, out):
            if isinstance(out, tuple) and out:
                return (self._slice(out[0], mesh, where, seen),) + out[1:]
            return self._slice(out, mesh, where, seen)

        record.add_hook(module.register_forward_pre_hook(pre, with_kwargs=True))
        record.add_hook(module.register_forward_hook(post))
        return module

    def _gather(self, x, mesh: DeviceMesh, where: str, seen: dict) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise LayoutError(f"{where}: expected the stream as a tensor, got {type(x).__name__}")
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(self.sequence_dim),), run_check=False)
        x = x.redistribute(mesh, (Replicate(),)).to_local()
        seen["shape"] = tuple(x.shape)
        return x

    def _slice(self, y, mesh: DeviceMesh, where: str, seen: dict) -> torch.Tensor:
        if not isinstance(y, torch.Tensor) or isinstance(y, DTensor):
            raise LayoutError(f"{where}: expected a local tensor as the first output, got {type(y).__name__}")
        shape, dim = seen.get("shape"), self.sequence_dim
        lead = shape[:dim + 1] if shape else None
        flat = lead is not None and y.ndim < len(shape) and y.shape[0] == math.prod(lead) and y.ndim >= 1
        z = y.reshape(*lead, *y.shape[1:]) if flat else y
        z = DTensor.from_local(z, mesh, (Replicate(),), run_check=False).redistribute(mesh, (Shard(dim),)).to_local()
        return z.reshape(-1, *y.shape[1:]) if flat else z
