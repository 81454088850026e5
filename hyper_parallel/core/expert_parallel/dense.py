"""DenseExpertsParallel: experts that run every expert on every (pre-scaled) token, split over tp.

Llama-4's ``Llama4TextExperts`` takes no routing: its MoE block repeats the tokens once per
expert, scales each copy by that expert's router score (zero for experts not chosen) and calls
``experts(hidden)`` with ``hidden`` of shape ``(E * tokens, H)``. The container computes
``bmm(x, gate_up_proj)`` with ``gate_up_proj`` ``(E, H, 2F)`` cut into gate and up halves,
then ``bmm(., down_proj)`` with ``down_proj`` ``(E, F, H)``. ExpertParallel cannot be applied to it,
because it reads ``(hidden_states, top_k_index, top_k_weights)``.

Split over the tp mesh as Megatron splits an MLP: each rank keeps its slice of both the gate and
the up half of every expert (``_StridedShard`` on the last dim), and the matching rows of
``down_proj`` (``Shard(1)``). The input is copied into the split (Megatron's f: its gradient is
all-reduced in backward) and the partial outputs are all-reduced in forward (g).
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_parallel.core.expert_parallel.dispatch import CopyToTP, ReduceFromTP
from hyper_parallel.core.expert_parallel.layouts import local
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle, check_divides, shard_dims
from hyper_parallel.errors import UnsupportedModuleError


# gate_up_proj (E, H, 2F): each rank its slice of the gate and of the up half; down_proj (E, F, H) by rows
_PLACEMENTS = {"gate_up_proj": _StridedShard(2, split_factor=2), "down_proj": Shard(1)}


class DenseExpertsParallel(ParallelStyle):
    """Each expert of a dense experts module (forward(hidden) over all experts) split over the mesh."""

    _args: dict = {}

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        where = f"DenseExpertsParallel on {fqn or '<root>'}"
        gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        ok = isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.ndim == 3 and down.ndim == 3
        if not ok or gu.shape[0] != down.shape[0] or gu.shape[2] != 2 * down.shape[1] or gu.shape[1] != down.shape[2]:
            raise UnsupportedModuleError(
                f"{where}: expected 3-D gate_up_proj (E, H, 2F) and down_proj (E, F, H) parameters, got "
                f"{tuple(gu.shape) if isinstance(gu, torch.Tensor) else gu} and "
                f"{tuple(down.shape) if isinstance(down, torch.Tensor) else down}")
        if not callable(getattr(module, "act_fn", None)):
            raise UnsupportedModuleError(f"{where}: expected the gate activation as module.act_fn")
        check_divides(down.shape[1], mesh, where, "the expert ffn width F")

    def param_shard_dims(self, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, bool]]:
        return shard_dims({n: p for n, p in _PLACEMENTS.items() if n in params})

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        for name, placement in _PLACEMENTS.items():
            new = record.sharded(module._parameters[name], (placement,), mesh, where=f"{fqn}.{name}")
            record.replace_param(module, name, new)
        group = mesh.get_group()

        def forward(hidden_states: torch.Tensor) -> torch.Tensor:
            gu, down = local(module.gate_up_proj), local(module.down_proj)
            x = CopyToTP.apply(hidden_states, group).view(gu.shape[0], -1, gu.shape[1])
            gate, up = torch.bmm(x, gu).chunk(2, dim=-1)
            out = torch.bmm(up * module.act_fn(gate), down)
            return ReduceFromTP.apply(out, group).view(-1, down.shape[-1])

        record.set_attr(module, "forward", forward)
        return module
