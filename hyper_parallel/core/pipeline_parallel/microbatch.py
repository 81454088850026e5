"""Micro-batching: split a step's args and kwargs along per-argument batch dimensions.

Each tensor argument is split along its ``BatchDimSpec`` dim (default 0); ``BatchDimSpec(-1)``
means "not split": every micro-batch sees the whole value. Non-tensor values are passed to every
micro-batch as they are; a :class:`PerMicrobatch` value gives each micro-batch its own. A DTensor is split on its local tensor and re-wrapped with the same mesh
and placements; if its batch dim is itself sharded, micro-batch i holds the i-th slice of every
shard. A dimension the micro-batch count does not divide is an error naming the argument.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from hyper_parallel.errors import MicrobatchError


@dataclass(frozen=True)
class BatchDimSpec:
    """The dimension of an argument that holds the batch; -1 means "do not split"."""

    dim: int = 0

    @property
    def split(self) -> bool:
        return self.dim != -1


NO_SPLIT = BatchDimSpec(-1)


class PerMicrobatch(tuple):
    """A step keyword given per micro-batch: micro-batch i gets item i. For inputs no dimension of
    the whole batch cuts into the micro-batches' own: a VL model's image-grid inputs (cumulative
    sequence lengths and window indices over all of a batch's images, M-RoPE positions with the
    batch on dim 1), built for each micro-batch's rows instead."""


def _split_tensor(value: torch.Tensor, spec: BatchDimSpec, n: int, where: str) -> list[Any]:
    if not spec.split:
        return [value] * n
    local = value.to_local() if isinstance(value, DTensor) else value
    if not 0 <= spec.dim < local.dim():
        raise MicrobatchError(f"{where}: batch dim {spec.dim} is out of range for a "
                              f"{local.dim()}-d tensor of shape {tuple(local.shape)}")
    size = local.shape[spec.dim]
    if size % n:
        raise MicrobatchError(
            f"{where}: batch dim {spec.dim} has size {size}, which {n} micro-batches do not divide; "
            f"use a micro-batch count that divides {size} or a batch that is a multiple of {n}")
    chunks = local.tensor_split(n, dim=spec.dim)
    if not isinstance(value, DTensor):
        return list(chunks)
    mesh, placements = value.device_mesh, value.placements
    shape = list(value.shape)
    shape[spec.dim] //= n
    out = []
    for c in chunks:
        out.append(DTensor.from_local(c, mesh, placements, run_check=False, shape=torch.Size(shape),
                                      stride=_contiguous_stride(shape)))
    return out


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return tuple(reversed(stride))


def _spec(specs, key, where: str) -> BatchDimSpec:
    if specs is None:
        return BatchDimSpec(0)
    try:
        spec = specs[key]
    except (IndexError, KeyError):
        return BatchDimSpec(0)
    if spec is None:
        return NO_SPLIT
    if isinstance(spec, int):
        return BatchDimSpec(spec)
    if not isinstance(spec, BatchDimSpec):
        raise MicrobatchError(f"{where}: spec must be a BatchDimSpec, int or None, got {spec!r}")
    return spec


def split_microbatches(args: Sequence[Any], kwargs: Mapping[str, Any] | None, n: int,
                       arg_specs: Sequence[BatchDimSpec | int | None] | None = None,
                       kwarg_specs: Mapping[str, BatchDimSpec | int | None] | None = None,
                       ) -> tuple[list[tuple], list[dict]]:
    """``n`` (args, kwargs) micro-batches; tensors split by spec, everything else repeated."""
    if not isinstance(n, int) or n < 1:
        raise MicrobatchError(f"n_microbatches must be a positive int, got {n!r}")
    kwargs = dict(kwargs or {})
    if arg_specs is not None and len(arg_specs) > len(args):
        raise MicrobatchError(f"{len(arg_specs)} arg specs given for {len(args)} positional args")
    unknown = set(kwarg_specs or {}) - set(kwargs)
    if unknown:
        raise MicrobatchError(f"kwarg specs name arguments that were not passed: {sorted(unknown)}")
    arg_parts = []
    for i, a in enumerate(args):
        where = f"positional argument {i}"
        arg_parts.append(_split_tensor(a, _spec(arg_specs, i, where), n, where)
                         if isinstance(a, torch.Tensor) else [a] * n)
    kw_parts = {}
    for k, v in kwargs.items():
        where = f"keyword argument {k!r}"
        if isinstance(v, PerMicrobatch):
            if len(v) != n:
                raise MicrobatchError(f"{where}: given for {len(v)} micro-batches, the step has {n}")
            kw_parts[k] = list(v)
            continue
        kw_parts[k] = (_split_tensor(v, _spec(kwarg_specs, k, where), n, where)
                       if isinstance(v, torch.Tensor) else [v] * n)
    mb_args = [tuple(p[i] for p in arg_parts) for i in range(n)]
    mb_kwargs = [{k: p[i] for k, p in kw_parts.items()} for i in range(n)]
    return mb_args, mb_kwargs


