"""Head-aligned uneven tensor parallelism: attention whose head count the mesh size does not divide.

GPT-2 XL has 25 heads of 64. DTensor's ``Shard`` cuts a dimension into ``torch.chunk`` pieces of
equal width -- its 1600 query columns into 400s at tp=4, through the middle of heads -- and no
DTensor placement splits a dimension into the head-aligned pieces 6, 6, 6, 7. These two styles
split the attention's *work* by whole heads instead and keep every parameter whole and
replicated (the parameters are not divided; the heads' FLOPs and activations are):

- ``HeadRowsParallel`` on a q/k/v projection (nn.Linear or GPT-2's Conv1D) whose output is
  ``sections`` -- e.g. ``[25, 25, 25]`` for a fused [q|k|v] -- each of equal-width heads: rank r
  computes the output rows of heads ``[r*H//size, (r+1)*H//size)`` of every section and returns
  them as a plain local tensor ``[q_r | k_r | v_r]``, which the module's code cuts with its local
  head counts (PrepareHeadsInput with ``head_count``). Its input is made replicated (a DTensor
  boundary) and its gradient there is Partial: each rank's heads contribute their share, so it
  is all-reduced in backward, as a column-parallel projection's is.
- ``HeadColsParallel`` on the output projection: rank r multiplies its heads' features by the
  matching input rows of the weight, a partial sum reduced to ``output_layouts`` (all-reduce to
  Replicate, reduce-scatter to a sequence shard), then adds the bias.

Every weight gets gradients only in the rows of its rank's heads: a Partial gradient, which the
gradient-alignment hook all-reduces once per parameter per step (the price of keeping the
weights whole: a data-parallel-like reduction over tp). The output projection's bias is added
after the reduction, so on a replicated output each rank's bias gradient is already the whole one.
The bounds are the same integer split PrepareHeadsInput uses (``head_bounds``), so the weights'
rows, the module's head counts and the output projection's columns agree on every rank.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle, shard_params
from hyper_parallel.core.tensor_parallel.kv_styles import output_rows_forward
from hyper_parallel.core.tensor_parallel.linear_styles import is_conv1d, linear_features
from hyper_parallel.errors import DivisibilityError, LayoutError, StyleSpecError, UnsupportedModuleError


def head_bounds(heads: int, size: int, rank: int) -> tuple[int, int]:
    """The heads ``[lo, hi)`` rank ``rank`` of ``size`` computes: whole heads, as even as integers
    allow (25 over 4: 6, 6, 6, 7)."""
    return rank * heads // size, (rank + 1) * heads // size


def _check_heads(heads, where: str, name: str) -> None:
    if type(heads) is not int or heads < 1:
        raise StyleSpecError(f"{where}: {name} must be an int >= 1 (a head count), got {heads!r}")


def _layer_kind(module: nn.Module, where: str) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if is_conv1d(module):
        return "conv1d"
    raise UnsupportedModuleError(f"{where}: supports nn.Linear and transformers' Conv1D, got {type(module).__name__}")


def _out_dim(kind: str) -> int:
    return 0 if kind == "linear" else 1    # Conv1D stores its weight as [in, out]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated parameter's local tensor whose gradient is this rank's share (Partial)."""
    return t.to_local(grad_placements=(Partial(),)) if isinstance(t, DTensor) else t


def _check_mesh_heads(heads: int, mesh: DeviceMesh, where: str, what: str) -> None:
    if heads < mesh.size():
        raise DivisibilityError(f"{where}: {what} = {heads} is fewer than the mesh size {mesh.size()} "
                                f"(every rank needs at least one whole head)")


class _WholeHeadsStyle(ParallelStyle):
    """What both styles share: a Linear / Conv1D whose parameters stay whole and replicated."""

    def param_shard_dims(self, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, bool]]:
        return {}   # every parameter whole and replicated

    @staticmethod
    def _whole(module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str, where: str) -> str:
        """The layer's kind, its parameters made replicated DTensors."""
        kind = _layer_kind(module, where)
        shard_params(module, mesh, record, {}, Replicate(), fqn)
        return kind


class HeadRowsParallel(_WholeHeadsStyle):
    """A q/k/v projection computing only its rank's whole heads of each section; see the module
    docstring."""

    _args = {"sections": None, "input_layouts": None}
    _layout_args = frozenset({"input_layouts"})

    def __init__(self, *, sections: list[int] | None = None, input_layouts: Placement | None = None):
        where = "HeadRowsParallel"
        if not isinstance(sections, (list, tuple)) or not sections:
            raise StyleSpecError(f"{where}: sections must be a non-empty list of head counts (a fused [q|k|v] "
                                 f"of 25 heads each: [25, 25, 25]), got {sections!r}")
        for h in sections:
            _check_heads(h, where, "every entry of sections")
        if input_layouts is not None and not isinstance(input_layouts, Placement):
            raise LayoutError(f"{where}: input_layouts must be one Placement, got {input_layouts!r}")
        self.sections = [int(h) for h in sections]
        self.input_layouts = input_layouts

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        where = f"HeadRowsParallel on {fqn or '<root>'}"
        _layer_kind(module, where)
        out = linear_features(module)[1]
        if out % sum(self.sections):
            raise DivisibilityError(f"{where}: out_features = {out} is not {sum(self.sections)} equal head widths "
                                    f"(sections={self.sections})")
        for h in self.sections:
            _check_mesh_heads(h, mesh, where, "a section's heads")

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        where = f"HeadRowsParallel on {fqn or '<root>'}"
        kind = self._whole(module, mesh, record, fqn, where)
        width = linear_features(module)[1] // sum(self.sections)
        size, rank = mesh.size(), mesh.get_local_rank()
        rows, start = [], 0
        for h in self.sections:
            lo, hi = head_bounds(h, size, rank)
            rows.append(slice((start + lo) * width, (start + hi) * width))
            start += h
        record.set_attr(module, "forward",
                        output_rows_forward(module, mesh, where, self.input_layouts or Replicate(), rows, kind))
        return module


class HeadColsParallel(_WholeHeadsStyle):
    """The output projection of head-aligned uneven attention: its rank's heads' input rows, a
    partial sum reduced to ``output_layouts``; see the module docstring."""

    _args = {"heads": None, "output_layouts": None}
    _layout_args = frozenset({"output_layouts"})

    def __init__(self, *, heads: int | None = None, output_layouts: Placement | None = None):
        where = "HeadColsParallel"
        _check_heads(heads, where, "heads")
        if output_layouts is not None and not (isinstance(output_layouts, Replicate) or
                                               isinstance(output_layouts, Shard)):
            raise LayoutError(f"{where}: output_layouts must be Replicate() or Shard(d), got {output_layouts!r}")
        self.heads = int(heads)
        self.output_layouts = output_layouts

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        where = f"HeadColsParallel on {fqn or '<root>'}"
        _layer_kind(module, where)
        if linear_features(module)[0] % self.heads:
            raise DivisibilityError(f"{where}: in_features = {linear_features(module)[0]} is not {self.heads} "
                                    f"equal head widths")
        _check_mesh_heads(self.heads, mesh, where, "heads")

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        where = f"HeadColsParallel on {fqn or '<root>'}"
        kind = self._whole(module, mesh, record, fqn, where)
        width = linear_features(module)[0] // self.heads
        lo, hi = head_bounds(self.heads, mesh.size(), mesh.get_local_rank())
        out_layout = self.output_layouts or Replicate()
        in_dim = 1 - _out_dim(kind)

        def forward(x: torch.Tensor) -> torch.Tensor:
            if isinstance(x, DTensor):
                raise LayoutError(f"{where}: expects the plain local features of this rank's heads, got a DTensor")
            if x.shape[-1] != (hi - lo) * width:
                raise LayoutError(f"{where}: input has {x.shape[-1]} features, this rank's heads [{lo}, {hi}) "
                                  f"are {(hi - lo) * width}")
            weight = _local(module.weight).narrow(in_dim, lo * width, (hi - lo) * width)
            partial = F.linear(x, weight) if kind == "linear" else \
                (x.reshape(-1, x.shape[-1]) @ weight).reshape(*x.shape[:-1], weight.shape[1])
            out = DTensor.from_local(partial, mesh, (Partial(),), run_check=False)
            out = out.redistribute(mesh, (out_layout,)).to_local()
            if module.bias is None:
                return out
            # a replicated output: every rank's bias gradient is already the whole one; a
            # sequence shard: each rank's tokens give a share (Partial)
            bias = module.bias.to_local() if isinstance(out_layout, Replicate) else _local(module.bias)
            return out + bias

        record.set_attr(module, "forward", forward)
        return module
