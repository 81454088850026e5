"""Column-wise and row-wise sharding of nn.Linear, GPT-2's Conv1D and nn.Embedding (Megatron's f/g pair).

Colwise shards the output features (Linear weight dim 0, Conv1D weight dim 1, Embedding dim 1)
so its output is sharded on the last dim; Rowwise shards the input features (Linear weight
dim 1, Conv1D weight dim 0) or the vocabulary (Embedding dim 0), producing a partial sum that
is reduced into ``output_layouts`` (all-reduce for Replicate, reduce-scatter for Shard(seq), the
sequence-parallel form).

Conv1D (``transformers.pytorch_utils.Conv1D``) is a linear layer with its weight stored
transposed ([in, out]) that computes ``addmm(bias, x, weight)``; DTensor runs that addmm on the
sharded weight as it runs Linear's matmul. It is recognised without importing transformers: a
model holding a Conv1D has already imported its module.
"""
from __future__ import annotations

import sys

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.core.tensor_parallel.base import (
    ApplyRecord,
    ParallelStyle,
    check_divides,
    finish_output,
    shard_params,
    to_dtensor,
)
from hyper_parallel.core.tensor_parallel.vocab_embedding import vocab_parallel_class
from hyper_parallel.errors import LayoutError, UnsupportedModuleError


CONV1D = "transformers.pytorch_utils.Conv1D"


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is (a subclass of) transformers' Conv1D, without importing transformers."""
    mod = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(mod, "Conv1D", None) if mod is not None else None
    return cls is not None and isinstance(module, cls)


def linear_features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]


def _single_input(inputs: tuple, where: str):
    if len(inputs) != 1:
        raise LayoutError(f"{where}: expected exactly 1 positional input, got {len(inputs)}")
    return inputs[0]


class _LinearStyle(ParallelStyle):
    _layout_args = frozenset({"input_layouts", "output_layouts"})

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True):
        for name, value in (("input_layouts", input_layouts), ("output_layouts", output_layouts)):
            if value is not None and not isinstance(value, Placement):
                raise LayoutError(f"{type(self).__name__}: {name} must be one Placement, got {value!r}")
        # None = the natural layout for the module kind (see _natural_input)
        self.input_layouts = input_layouts
        self.output_layouts = output_layouts if output_layouts is not None else self._args["output_layouts"]
        self.use_local_output = bool(use_local_output)

    def _kind(self, module: nn.Module, fqn: str) -> str:
        if isinstance(module, nn.Linear):
            return "linear"
        if is_conv1d(module):
            return "conv1d"
        if isinstance(module, nn.Embedding):
            return "embedding"
        raise UnsupportedModuleError(
            f"{type(self).__name__} on {fqn or '<root>'}: supports nn.Linear, transformers' Conv1D and nn.Embedding, "
            f"got {type(module).__name__}"
        )

    def _desired_input(self, kind: str) -> Placement:
        raise NotImplementedError

    def _weight_placement(self, kind: str) -> dict[str, Placement]:
        raise NotImplementedError

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        kind = self._kind(module, fqn)
        where = f"{type(self).__name__} on {fqn or '<root>'}"
        shard_params(module, mesh, record, self._weight_placement(kind), Replicate(), fqn)
        if kind == "embedding" and isinstance(self._weight_placement(kind)["weight"], Shard) \
                and self._weight_placement(kind)["weight"].dim == 0:
            record.set_attr(module, "__class__", vocab_parallel_class(type(module)))  # see vocab_embedding
        desired = self._desired_input(kind)
        layout = self.input_layouts if self.input_layouts is not None else desired

        # the whole width of a sharded input, so an uneven shard (from an uneven ColwiseParallel)
        # is annotated with its true global shape
        in_features = linear_features(module)[0] if kind != "embedding" else None

        def pre_hook(mod, inputs):
            x = _single_input(inputs, where)
            return (to_dtensor(x, mesh, layout, desired, where,
                               global_size=in_features if isinstance(layout, Shard) and layout.dim in (-1, x.ndim - 1)
                               else None),)

        record.add_hook(module.register_forward_pre_hook(pre_hook))
        record.add_hook(module.register_forward_hook(
            lambda mod, inputs, out: finish_output(out, mesh, self._output_layout(), self.use_local_output, where,
                                                   owned=getattr(self, "owned_output", False))
        ))
        return module

    def _output_layout(self) -> Placement | None:
        return self.output_layouts


class ColwiseParallel(_LinearStyle):
    """Shard output features. Input defaults (None) to Replicate; output to Shard(-1), local by default.

    ``packed=k``: the Linear's output is k projections concatenated ([gate|up], [q|k|v] of equal
    widths); each rank holds its slice of every one of them (DTensor's strided sharding), so
    its local output is [gate_r|up_r] and code that splits the output in k parts locally (Phi-3's
    ``chunk(2)``) gets its own slice of each. The output keeps that layout (no redistribution)."""

    _args = {"input_layouts": None, "output_layouts": Shard(-1), "use_local_output": True, "packed": 1}

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, packed: int = 1):
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        if not isinstance(packed, int) or isinstance(packed, bool) or packed < 1:
            raise LayoutError(f"ColwiseParallel: packed must be an int >= 1, got {packed!r}")
        self.packed = packed

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        kind = self._kind(module, fqn)
        where = f"ColwiseParallel on {fqn or '<root>'}"
        if kind != "embedding":
            out_features = linear_features(module)[1]
            if out_features % self.packed:
                raise LayoutError(f"{where}: out_features {out_features} is not {self.packed} packed "
                                  f"projections of equal width")
            if self.packed != 1:   # uneven strided shards would mix the packed projections
                check_divides(out_features // self.packed, mesh, where, "out_features per packed projection")
            # packed=1: out_features need not divide the mesh (DTensor's uneven Shard: the first ranks
            # hold one row more), as with torch's ColwiseParallel
        else:
            if self.packed != 1:
                raise UnsupportedModuleError(f"{where}: packed applies to nn.Linear and Conv1D only")
            check_divides(module.embedding_dim, mesh, where, "embedding_dim")

    def _desired_input(self, kind: str) -> Placement:
        return Replicate()

    def _weight_placement(self, kind: str) -> dict[str, Placement]:
        if kind in ("linear", "conv1d"):
            out_dim = 0 if kind == "linear" else 1      # Conv1D stores the weight as [in, out]
            rows = Shard(out_dim) if self.packed == 1 else _StridedShard(out_dim, split_factor=self.packed)
            bias = Shard(0) if self.packed == 1 else _StridedShard(0, split_factor=self.packed)
            return {"weight": rows, "bias": bias}
        return {"weight": Shard(1)}

    def _output_layout(self) -> Placement | None:
        return self.output_layouts if self.packed == 1 else None


class RowwiseParallel(_LinearStyle):
    """Shard input features (Linear) or the vocabulary (Embedding); reduce the partial output.

    Input defaults (None) to Shard(-1) for Linear (the output of a Colwise) and Replicate for
    Embedding (token ids) -- unlike torch, which annotates token ids as Shard(-1); output defaults to Replicate (all-reduce). Shard(1) gives a reduce-scatter.
    """

    _args = {"input_layouts": None, "output_layouts": Replicate(), "use_local_output": True, "owned_output": False}

    def __init__(self, *, input_layouts: Placement | None = None, output_layouts: Placement | None = None,
                 use_local_output: bool = True, owned_output: bool = False):
        """``owned_output`` (no torch equivalent): return a copy of the local result, which the
        caller may modify in place -- Falcon's block adds the attention output into the MLP
        output with ``+=``, which autograd forbids on DTensor's local view. Costs one copy of the
        output; off by default."""
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts, use_local_output=use_local_output)
        self.owned_output = bool(owned_output)

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        self._kind(module, fqn)   # a module kind the style supports
        # in_features / num_embeddings need not divide the mesh: DTensor shards unevenly (the input
        # is annotated with its whole width, see apply) and a vocabulary-parallel embedding masks
        # each rank's own id range

    def _desired_input(self, kind: str) -> Placement:
        return Shard(-1) if kind != "embedding" else Replicate()

    def _weight_placement(self, kind: str) -> dict[str, Placement]:
        if kind in ("linear", "conv1d"):
            return {"weight": Shard(1 if kind == "linear" else 0), "bias": Replicate()}
        return {"weight": Shard(0)}
