"""MambaMixerParallel: a Mamba mixer split on its inner channels over tp (Megatron's form for SSMs).

A Mamba-2 mixer (no x_proj; one packed in_proj) is split on its heads by ``mamba2_split``; the rest
of this docstring is the Mamba-1 form.

A Mamba-1 mixer (Jamba's ``JambaMambaMixer``; the Mamba / Falcon-Mamba mixers share the layout)
projects the stream to ``[x | z]`` (``in_proj``, 2 x I channels), runs a depthwise convolution and
a selective scan per channel, and projects back (``out_proj``). Every per-channel piece is cut on
the I channels: ``in_proj`` column-wise with each rank its slice of both x and z
(``_StridedShard(0, split_factor=2)``), ``conv1d``'s weight and bias, ``dt_proj``'s rows and bias,
``A_log`` and ``D`` on dim 0, ``out_proj`` row-wise. One piece mixes channels: ``x_proj`` maps the
I channels to the (dt, B, C) of the scan, so on a rank it gives a partial sum -- all-reduced in
forward -- and (dt, B, C) are then computed whole on every rank. Each rank uses them only with
its channels, so their gradients are partial: they are all-reduced in backward where they are
last whole -- after the modules named in ``replicated_after`` (Jamba's dt/B/C layer norms, whose
weights then get whole gradients), or at ``x_proj``'s output when none is named. The mixer's
input is copied into the split (its gradient all-reduced in backward) and ``out_proj``'s partial
output all-reduced in forward. The module's ``intermediate_size`` is made local, so its own code
runs on the local channels. The parameters become DTensors sharded on those dims; the norms stay
plain tensors, replicated.

On a sequence-sharded stream (``sequence_dim``) the scan and the convolution still need the whole
sequence: the mixer gathers it at its input (the partial input gradient reduce-scattered in
backward) and reduce-scatters its partial output back onto the sequence (``sequence_region``) --
the same bytes as the two all-reduces, and the stream stays sharded outside the mixer.
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
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle, check_divides, shard_dims
from hyper_parallel.core.tensor_parallel.sequence_region import region_in, region_out
from hyper_parallel.core.tensor_parallel.mamba2_split import apply_mamba2, check_mamba2, is_mamba2, mamba2_placements
from hyper_parallel.errors import StyleSpecError, UnsupportedModuleError

# parameter (path in the mixer) -> its placement on the tp mesh
_PLACEMENTS = {"in_proj.weight": _StridedShard(0, split_factor=2), "in_proj.bias": _StridedShard(0, split_factor=2),
               "conv1d.weight": Shard(0), "conv1d.bias": Shard(0), "x_proj.weight": Shard(1),
               "dt_proj.weight": Shard(0), "dt_proj.bias": Shard(0), "A_log": Shard(0), "D": Shard(0),
               "out_proj.weight": Shard(1)}


def _param(module: nn.Module, path: str):
    owner, _, name = path.rpartition(".")
    sub = module.get_submodule(owner) if owner else module
    return sub, name, sub._parameters.get(name)


class MambaMixerParallel(ParallelStyle):
    """A Mamba-1 mixer split on its inner channels, a Mamba-2 mixer on its heads; see the module docstring."""

    _args = {"replicated_after": None, "sequence_dim": None}

    def __init__(self, *, replicated_after: list[str] | None = None, sequence_dim: int | None = None):
        if replicated_after is not None and (not isinstance(replicated_after, (list, tuple)) or
                                             not all(isinstance(p, str) and p for p in replicated_after)):
            raise StyleSpecError(f"MambaMixerParallel: replicated_after must be a list of submodule paths, "
                                 f"got {replicated_after!r}")
        self.replicated_after = sorted(replicated_after) if replicated_after else None
        if sequence_dim is not None and (type(sequence_dim) is not int or sequence_dim < 0):
            raise StyleSpecError(f"MambaMixerParallel: sequence_dim must be a non-negative int (the input's "
                                 f"sequence dimension on a sequence-sharded stream) or None, got {sequence_dim!r}")
        # None: the mixer takes and gives a replicated stream (f/g all-reduces); an int: a stream
        # sharded on that dimension, gathered at the input and reduce-scattered at the output (the
        # scan and the convolution need the whole sequence)
        self.sequence_dim = sequence_dim

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        where = f"MambaMixerParallel on {fqn or '<root>'}"
        if is_mamba2(module):
            if self.replicated_after:
                raise StyleSpecError(f"{where}: replicated_after names Mamba-1 norms; a Mamba-2 mixer has none")
            check_mamba2(module, mesh, where)
            return
        inner = getattr(module, "intermediate_size", None)
        if type(inner) is not int:
            raise UnsupportedModuleError(f"{where}: expected the inner width as an int intermediate_size")
        for name in ("in_proj", "x_proj", "dt_proj", "out_proj"):
            if not isinstance(getattr(module, name, None), nn.Linear):
                raise UnsupportedModuleError(f"{where}: expected {name} as an nn.Linear (a Mamba-1 mixer)")
        if not isinstance(getattr(module, "conv1d", None), nn.Conv1d) or module.conv1d.groups != inner:
            raise UnsupportedModuleError(f"{where}: expected conv1d as a depthwise nn.Conv1d over intermediate_size")
        if module.out_proj.bias is not None:
            raise UnsupportedModuleError(f"{where}: out_proj has a bias (a row-parallel sum would add it per rank)")
        shapes = {"in_proj.weight": 2 * inner, "x_proj.weight": None, "dt_proj.weight": inner, "A_log": inner,
                  "D": inner, "conv1d.weight": inner}
        for path, rows in shapes.items():
            _, _, p = _param(module, path)
            if p is None or (rows is not None and p.shape[0] != rows):
                raise UnsupportedModuleError(f"{where}: {path} is not a parameter with {rows} rows")
        if module.x_proj.weight.shape[1] != inner or module.out_proj.weight.shape[1] != inner:
            raise UnsupportedModuleError(f"{where}: x_proj / out_proj do not read the {inner} inner channels")
        for path in self.replicated_after or []:
            try:
                module.get_submodule(path)
            except AttributeError as exc:
                raise UnsupportedModuleError(f"{where}: replicated_after names no submodule {path!r}") from exc
        check_divides(inner, mesh, where, "the inner width (intermediate_size)")

    def param_shard_dims(self, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, bool]]:
        if "x_proj.weight" not in params:   # a Mamba-2 mixer (no x_proj / dt_proj): split on heads
            return shard_dims(mamba2_placements(params))
        return shard_dims({path: p for path, p in _PLACEMENTS.items() if path in params})

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        if is_mamba2(module):
            return apply_mamba2(module, mesh, record, fqn, self.sequence_dim)
        sharded = []
        for path, placement in _PLACEMENTS.items():
            owner, name, p = _param(module, path)
            if p is None:
                continue
            record.replace_param(owner, name, record.sharded(p, (placement,), mesh, where=f"{fqn}.{path}"))
            sharded.append(path)
        record.set_attr(module, "intermediate_size", module.intermediate_size // mesh.size())
        group = mesh.get_group()
        after = self.replicated_after or []

        def reduce_out(mod, args, output):     # x_proj's partial sums, whole again
            out = ReduceFromTP.apply(output, group)
            return out if after else CopyToTP.apply(out, group)

        def copy_out(mod, args, output):       # last whole here: partial gradients reduced
            return CopyToTP.apply(output, group)

        record.add_hook(module.x_proj.register_forward_hook(reduce_out))
        for path in after:
            record.add_hook(module.get_submodule(path).register_forward_hook(copy_out))
        inner, seq = module.forward, self.sequence_dim

        def forward(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            x = region_in(hidden_states, group, seq)
            params = {path: local(_param(module, path)[2]) for path in sharded}
            with _reparametrize_module(module, params):
                out = inner(x, *args, **kwargs)
            return region_out(out, group, seq)

        record.set_attr(module, "forward", forward)
        return module
