"""AllReduceGradColumns: a replicated linear whose output columns feed every head of a head-sharded attention.

DeepSeek's multi-head latent attention (MLA) computes ``kv_a_proj_with_mqa(x) = [kv_latent |
k_rot]``: the latent goes through ``kv_b_proj`` (column-parallel when heads are sharded, which
all-reduces its input gradient in backward, so the latent's gradient is whole), but ``k_rot`` --
one rotary key per token -- is broadcast to the heads (``expand``) and written beside each
head's key. On a rank holding 1/tp of the heads, the gradient of ``k_rot`` sums only the local
heads: a partial sum over tp. Left alone, the weight gradient of ``kv_a_proj_with_mqa`` and the
residual stream's gradient through it would be silently wrong (the loss stays equal).

This style keeps the module replicated (plain parameters, forward unchanged) and, in backward,
all-reduces exactly those output columns of the gradient over the tensor-parallel group; the
other columns are left as they are (already whole). torchtitan keeps the latent path in DTensor
instead; HF's MLA code writes k into a ``new_empty`` buffer through slice ``copy_``, which
mixes DTensors and local tensors, so the reduction is made explicit here. Its cost is one
all-reduce of ``tokens x (stop - start)`` elements per layer in backward.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle
from hyper_parallel.core.tensor_parallel.linear_styles import is_conv1d, linear_features
from hyper_parallel.errors import LayoutError, StyleSpecError, UnsupportedModuleError


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _ReduceGradColumns(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient's last-dimension columns [start, stop)."""

    @staticmethod
    def forward(ctx, x, start: int, stop: int, group):
        ctx.start, ctx.stop, ctx.group = start, stop, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        start, stop = ctx.start, ctx.stop
        part = _wait(funcol.all_reduce(grad[..., start:stop].contiguous(), "sum", ctx.group))
        return torch.cat([grad[..., :start], part, grad[..., stop:]], dim=-1), None, None, None


class AllReduceGradColumns(ParallelStyle):
    """Keep a linear layer replicated; all-reduce its output gradient's ``columns`` ([start, stop)
    of the last dimension) over the mesh in backward. For the columns of a replicated projection
    that reach a head-sharded attention core broadcast to every head (MLA's rotary key)."""

    _args = {"columns": None}

    def __init__(self, *, columns: list[int] | None = None):
        if not isinstance(columns, (list, tuple)) or len(columns) != 2 or \
                not all(type(c) is int for c in columns) or not 0 <= columns[0] < columns[1]:
            raise StyleSpecError(f"AllReduceGradColumns: columns must be [start, stop] with 0 <= start < stop, "
                                 f"got {columns!r}")
        self.columns = [int(columns[0]), int(columns[1])]

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        where = f"AllReduceGradColumns on {fqn or '<root>'}"
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise UnsupportedModuleError(f"{where}: expects an nn.Linear or Conv1D, got {type(module).__name__}")
        out = linear_features(module)[1]
        if self.columns[1] > out:
            raise LayoutError(f"{where}: columns {self.columns} exceed the {out} output features "
                              f"(valid: 0 <= start < stop <= {out})")

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        where = f"AllReduceGradColumns on {fqn or '<root>'}"
        start, stop = self.columns
        group = mesh.get_group()

        def post_hook(mod, inputs, out):
            if isinstance(out, DTensor) or not isinstance(out, torch.Tensor):
                raise LayoutError(f"{where}: expected a plain tensor output (a replicated module), "
                                  f"got {type(out).__name__}")
            return _ReduceGradColumns.apply(out, start, stop, group)

        record.add_hook(module.register_forward_hook(post_hook))
        return module
