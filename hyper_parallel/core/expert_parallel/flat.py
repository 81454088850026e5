"""FlatExpertsParallel: experts held as flat 2-D weights ``(E * F, H)``, each split on its ffn width over tp.

DBRX keeps its experts in ``experts.mlp`` as three parameters ``w1``, ``v1``, ``w2`` of shape
``(num_experts * ffn, hidden)``; its forward ``(hidden_states, top_k_index, top_k_weights)``
views each as ``(-1, ffn_hidden_size, hidden)``, picks the routed experts, computes
``(act(x w1^T) * (x v1^T)) w2`` per expert and adds the outputs, scaled by ``top_k_weights``, into
the result. ExpertParallel cannot be applied to it: it expects stacked 3-D ``gate_up_proj`` /
``down_proj``.

Split over the tp mesh as Megatron splits an MLP: each rank keeps, of every expert, its slice of
the ffn rows of ``w1``, ``v1`` and ``w2`` (``_StridedShard(0, split_factor=E)``: the rows of each of
the E experts are sharded, not the E blocks) and the module's ``ffn_hidden_size`` becomes the local
width, so its own view and loop run unchanged on the local rows. Routing is replicated (every
rank routes the same tokens), so the hidden states and the routing weights are copied into the
split (Megatron's f: their gradients, partial on each rank, all-reduced in backward) and the
partial outputs are all-reduced in forward (g). The forward the module had when the style was
applied is the one run inside, so a stand-in (the planner's probe on fake tensors) stays in place.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.utils.stateless import _reparametrize_module

from hyper_parallel.core.expert_parallel.dispatch import CopyToTP, ReduceFromTP
from hyper_parallel.core.expert_parallel.layouts import local
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle, check_divides
from hyper_parallel.errors import UnsupportedModuleError

_WEIGHTS = ("w1", "v1", "w2")


class FlatExpertsParallel(ParallelStyle):
    """Each expert of a module holding flat ``(E * F, H)`` expert weights split on F over the mesh.
    E is read from the module (its rows over its ``ffn_hidden_size``), so one plan fits a copy with
    fewer experts."""

    _args: dict = {}

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        where = f"FlatExpertsParallel on {fqn or '<root>'}"
        mlp = getattr(module, "mlp", None)
        params = [getattr(mlp, n, None) for n in _WEIGHTS]
        if not all(isinstance(p, nn.Parameter) and p.ndim == 2 for p in params) or \
                len({tuple(p.shape) for p in params}) != 1:
            raise UnsupportedModuleError(f"{where}: expected module.mlp.w1 / v1 / w2 as 2-D parameters of one shape "
                                         f"(num_experts * ffn, hidden)")
        ffn = getattr(module, "ffn_hidden_size", None)
        rows = params[0].shape[0]
        if type(ffn) is not int or ffn < 1 or rows % ffn:
            raise UnsupportedModuleError(f"{where}: {rows} weight rows are not a multiple of the module's "
                                         f"ffn_hidden_size={ffn!r}")
        check_divides(ffn, mesh, where, "the expert ffn width (ffn_hidden_size)")

    def param_shard_dims(self, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, bool]]:
        """Each expert's rows of w1 / v1 / w2: dim 0, strided (one stride per expert)."""
        return {f"mlp.{n}": (0, True) for n in _WEIGHTS if f"mlp.{n}" in params}

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        mlp, size = module.mlp, mesh.size()
        experts = mlp.w1.shape[0] // module.ffn_hidden_size
        for name in _WEIGHTS:
            new = record.sharded(mlp._parameters[name], (_StridedShard(0, split_factor=experts),), mesh,
                                 where=f"{fqn}.mlp.{name}")
            record.replace_param(mlp, name, new)
        for owner in (module, mlp):
            if isinstance(getattr(owner, "ffn_hidden_size", None), int):
                record.set_attr(owner, "ffn_hidden_size", owner.ffn_hidden_size // size)
        inner, group = module.forward, mesh.get_group()

        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    *args, **kwargs) -> torch.Tensor:
            x = CopyToTP.apply(hidden_states, group)
            weights = CopyToTP.apply(top_k_weights, group)
            with _reparametrize_module(mlp, {n: local(mlp._parameters[n]) for n in _WEIGHTS}):
                out = inner(x, top_k_index, weights, *args, **kwargs)
            return ReduceFromTP.apply(out, group)

        record.set_attr(module, "forward", forward)
        return module
