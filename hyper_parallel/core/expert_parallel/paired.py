"""PairedExpertsParallel: experts held as two modules of stacked 3-D weights, split on the ffn width over tp.

JetMoE's MoE MLP keeps its experts in two child modules, ``input_linear`` (weight ``(E, 2F, H)``)
and ``output_linear`` (weight ``(E, H, F)``); the container routes the tokens, sorts their copies
by expert, calls ``input_linear(rows, expert_size)`` (each expert's rows through ``F.linear`` with
its slice of the weight), chunks the result into gate and up halves, and calls
``output_linear`` on the gated rows. Neither ExpertParallel (it expects ``gate_up_proj`` /
``down_proj`` called with the routing) nor FlatExpertsParallel (flat 2-D weights) applies.

Split over the tp mesh as Megatron splits an MLP: every rank keeps every expert and routes the
same tokens; of every expert it keeps its slice of the up module's output width (both halves when
it is ``packed`` [gate|up]: ``_StridedShard(up_dim, split_factor=packed)``) and the matching input
columns of the down module (``Shard(down_dim)``). The modules' own forwards run unchanged on the
local weights (an expert's rows keep their count; only their width is local). The up module's
input is copied into the split (Megatron's f: its gradient, partial on each rank, all-reduced in
backward) and the down module's partial output all-reduced in forward (g), so what the container
does after it (gate weights, scatter back, bias) runs on whole values. Which weight dimension is
the width is read from the captured shapes by the planner and passed in (``up_dim``,
``down_dim``), so a module storing ``(E, in, out)`` is split as well.

The same split shards the heads of a mixture of attention heads (JetMoE's MoA: per-expert query
projections ``input_linear`` (E, D, H) and output projections ``output_linear`` (E, H, D) around an
attention core): the width D is the routed token's query heads, ``head_dim`` wide each, and each
rank keeps whole heads of every expert (``head_dim``: the split must fall between heads). The
container's code may size its buffers by the width it stores (``hidden_size`` = D):
``local_attributes`` names those integer attributes, divided by the mesh size on apply.

On a sequence-sharded stream the container that holds the experts is itself the module to gather
the sequence into (JetMoE's MoE MLP routes inside the module the style is on), and a module takes
one style: ``sequence_dim`` makes this style also what ``GatheredRegion`` is -- the stream gathered
on that dimension at the container's input and its (first) output sliced back to the rank's shard.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils.stateless import _reparametrize_module

from hyper_parallel.core.expert_parallel.dispatch import CopyToTP, ReduceFromTP
from hyper_parallel.core.expert_parallel.layouts import local
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle, check_divides
from hyper_parallel.core.tensor_parallel.sequence_region import GatheredRegion
from hyper_parallel.errors import StyleSpecError, UnsupportedModuleError


class PairedExpertsParallel(ParallelStyle):
    """The experts of a container with an up and a down module of stacked 3-D weights, each expert
    split on its ffn width over the mesh; see the module docstring."""

    _args = {"up": "", "down": "", "up_dim": 1, "down_dim": 2, "packed": 1, "weight": "weight", "head_dim": None,
             "local_attributes": None, "sequence_dim": None}

    def __init__(self, *, up: str, down: str, up_dim: int = 1, down_dim: int = 2, packed: int = 1,
                 weight: str = "weight", head_dim: int | None = None, local_attributes: list[str] | None = None,
                 sequence_dim: int | None = None):
        if not (isinstance(up, str) and up and isinstance(down, str) and down and up != down):
            raise StyleSpecError(f"PairedExpertsParallel: up and down must name two submodules, got {up!r}, {down!r}")
        if up_dim not in (1, 2) or down_dim not in (1, 2):
            raise StyleSpecError(f"PairedExpertsParallel: up_dim={up_dim}, down_dim={down_dim}: the split width is "
                                 f"dim 1 or 2 of an (E, ., .) weight")
        if type(packed) is not int or packed < 1:
            raise StyleSpecError(f"PairedExpertsParallel: packed={packed!r} must be a positive int (2 for [gate|up])")
        if head_dim is not None and (type(head_dim) is not int or head_dim < 1):
            raise StyleSpecError(f"PairedExpertsParallel: head_dim={head_dim!r} must be a positive int or None")
        attrs = list(local_attributes or [])
        if not all(isinstance(a, str) and a.isidentifier() for a in attrs):
            raise StyleSpecError(f"PairedExpertsParallel: local_attributes={local_attributes!r} must name attributes "
                                 f"of the container")
        self.up, self.down, self.up_dim, self.down_dim = up, down, up_dim, down_dim
        self.packed, self.weight, self.head_dim = packed, weight, head_dim
        self.local_attributes = sorted(set(attrs)) or None
        self.region = None if sequence_dim is None else GatheredRegion(sequence_dim=sequence_dim)
        self.sequence_dim = sequence_dim

    def _weights(self, module: nn.Module, where: str) -> tuple[nn.Module, nn.Module, nn.Parameter, nn.Parameter]:
        mods = []
        for path in (self.up, self.down):
            try:
                sub = module.get_submodule(path)
            except AttributeError:
                raise UnsupportedModuleError(f"{where}: no submodule {path!r}") from None
            w = sub._parameters.get(self.weight)
            if not isinstance(w, nn.Parameter) or w.ndim != 3:
                raise UnsupportedModuleError(f"{where}: expected {path}.{self.weight} as a 3-D (E, ., .) parameter, "
                                             f"got {tuple(w.shape) if isinstance(w, torch.Tensor) else w!r}")
            mods.append((sub, w))
        (up, wu), (down, wd) = mods
        return up, down, wu, wd

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        where = f"PairedExpertsParallel on {fqn or '<root>'}"
        _, _, wu, wd = self._weights(module, where)
        ffn = wd.shape[self.down_dim]
        if wu.shape[0] != wd.shape[0] or wu.shape[self.up_dim] != self.packed * ffn:
            raise UnsupportedModuleError(
                f"{where}: {self.up}.{self.weight} {tuple(wu.shape)} and {self.down}.{self.weight} {tuple(wd.shape)} "
                f"are not E experts of width {self.packed} x F (up dim {self.up_dim}) and F (down dim {self.down_dim})")
        if self.head_dim is None:
            check_divides(ffn, mesh, where, "the expert ffn width F")
        elif ffn % self.head_dim:
            raise UnsupportedModuleError(f"{where}: the width {ffn} is no whole number of heads of {self.head_dim}")
        else:
            check_divides(ffn // self.head_dim, mesh, where, f"the heads ({ffn} wide, {self.head_dim} each)")
        for name in self.local_attributes or ():
            value = getattr(module, name, None)
            if type(value) is not int:
                raise UnsupportedModuleError(f"{where}: local_attributes entry {name!r} is {value!r}, not an int "
                                             f"attribute of {type(module).__name__}")
            check_divides(value, mesh, where, name)
        if self.region is not None:
            self.region.check_module(module, mesh, fqn)

    def param_shard_dims(self, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, bool]]:
        """The up weight on ``up_dim`` (strided when ``packed``), the down weight on ``down_dim``."""
        out = {f"{self.up}.{self.weight}": (self.up_dim, self.packed > 1),
               f"{self.down}.{self.weight}": (self.down_dim, False)}
        return {k: v for k, v in out.items() if k in params}

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        up, down, _, _ = self._weights(module, fqn)
        up_place = _StridedShard(self.up_dim, split_factor=self.packed) if self.packed > 1 else Shard(self.up_dim)
        for sub, path, placement in ((up, self.up, up_place), (down, self.down, Shard(self.down_dim))):
            new = record.sharded(sub._parameters[self.weight], (placement,), mesh, where=f"{fqn}.{path}.{self.weight}")
            record.replace_param(sub, self.weight, new)
        for attr in self.local_attributes or ():   # restored by the record's rollback
            record.set_attr(module, attr, getattr(module, attr) // mesh.size())
        group, name = mesh.get_group(), self.weight

        def split(sub: nn.Module, first: bool):
            inner = sub.forward

            def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
                if first:
                    x = CopyToTP.apply(x, group)
                with _reparametrize_module(sub, {name: local(sub._parameters[name])}):
                    out = inner(x, *args, **kwargs)
                return out if first else ReduceFromTP.apply(out, group)
            return forward

        record.set_attr(up, "forward", split(up, True))
        record.set_attr(down, "forward", split(down, False))
        if self.region is not None:   # the container also gathers the sequence-sharded stream
            self.region.apply(module, mesh, record, fqn)
        return module
