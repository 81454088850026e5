"""PrepareLatentInput: a head-sharded latent attention (DeepSeek's MLA) whose rotary key is broadcast to every head.

DeepSeek's multi-head latent attention computes ``kv_a_proj_with_mqa(x) = [kv_latent | k_rot]``.
With its heads sharded (torchtitan's DeepSeek plan shards the same modules), ``kv_b_proj`` is
column-parallel and all-reduces its input gradient in backward, so the latent's gradient is
whole; but ``k_rot`` -- one rotary key per token -- is broadcast to the heads (``expand``) and
written beside each head's key. On a rank holding 1/tp of the heads, the gradient of ``k_rot``
sums only the local heads: a partial sum over tp. Left alone, the weight gradient of
``kv_a_proj_with_mqa`` and the residual stream's gradient through it are silently wrong, while
the loss stays equal to one device.

This style does what PrepareModuleInput does at the attention module and, in backward,
all-reduces exactly the broadcast columns of ``broadcast_linear``'s output gradient over the
tensor-parallel group (the other columns are whole already). The linear itself stays replicated
with plain parameters. torchtitan keeps the latent path in DTensor instead; HF's MLA code writes
k into a ``new_empty`` buffer through slice ``copy_`` beside local tensors, so the reduction is
made explicit here. Its cost: one all-reduce of ``tokens x columns`` elements per layer, backward.

The columns are named the way the module's own code cuts them -- ``[start, stop]``, each an int
or the path of an integer attribute of the module (``"kv_lora_rank"``, ``"config.kv_lora_rank"``),
``stop`` None for the linear's last column -- so one plan fits the model at any width (planned at
full size, checked on a small copy), as PrepareHeadsInput's ``local_attributes`` do.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hyper_parallel.core.tensor_parallel.base import ApplyRecord
from hyper_parallel.core.tensor_parallel.head_styles import _owner
from hyper_parallel.core.tensor_parallel.linear_styles import is_conv1d, linear_features
from hyper_parallel.core.tensor_parallel.prepare_styles import PrepareModuleInput
from hyper_parallel.errors import LayoutError, StyleSpecError


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


def _is_spec(v, allow_none: bool) -> bool:
    if v is None:
        return allow_none
    if type(v) is int:
        return v >= 0
    return isinstance(v, str) and v.count(".") <= 1 and all(p.isidentifier() for p in v.split("."))


class PrepareLatentInput(PrepareModuleInput):
    """PrepareModuleInput, plus: the output gradient of the replicated linear ``broadcast_linear``
    (a path below the module) is all-reduced over the mesh in backward on its
    ``broadcast_columns`` ([start, stop]: ints, attribute paths of the module, stop None for the
    last column) -- the columns a head-sharded core receives broadcast to every head."""

    _args = {**PrepareModuleInput._args, "broadcast_linear": None, "broadcast_columns": None}

    def __init__(self, *, broadcast_linear: str | None = None, broadcast_columns: list | None = None, **kwargs):
        super().__init__(**kwargs)
        where = type(self).__name__
        if not isinstance(broadcast_linear, str) or not broadcast_linear or \
                not all(p.isidentifier() or p.isdigit() for p in broadcast_linear.split(".")):
            raise StyleSpecError(f"{where}: broadcast_linear must be a submodule path such as "
                                 f"'kv_a_proj_with_mqa', got {broadcast_linear!r}")
        if not isinstance(broadcast_columns, (list, tuple)) or len(broadcast_columns) != 2 or \
                not _is_spec(broadcast_columns[0], False) or not _is_spec(broadcast_columns[1], True):
            raise StyleSpecError(f"{where}: broadcast_columns must be [start, stop], each a non-negative int or an "
                                 f"attribute path ('kv_lora_rank'), stop also None (to the last column); "
                                 f"got {broadcast_columns!r}")
        self.broadcast_linear = broadcast_linear
        self.broadcast_columns = list(broadcast_columns)

    def columns(self, module: nn.Module, fqn: str = "") -> tuple[int, int]:
        """The [start, stop) the column specs name on ``module`` (raises LayoutError if they cannot)."""
        where = f"{type(self).__name__} on {fqn or '<root>'}"
        try:
            linear = module.get_submodule(self.broadcast_linear)
        except AttributeError:
            raise LayoutError(f"{where}: {type(module).__name__} has no submodule {self.broadcast_linear!r}") from None
        if not (isinstance(linear, nn.Linear) or is_conv1d(linear)):
            raise LayoutError(f"{where}: {self.broadcast_linear} is a {type(linear).__name__}, not an nn.Linear "
                              f"or Conv1D")
        width = linear_features(linear)[1]
        bounds = []
        for spec, default in zip(self.broadcast_columns, (None, width)):
            if spec is None:
                bounds.append(default)
                continue
            if isinstance(spec, int):
                bounds.append(spec)
                continue
            obj, name = _owner(module, spec)
            value = getattr(obj, name, None) if obj is not None else None
            if type(value) is not int:
                raise LayoutError(f"{where}: {type(module).__name__}.{spec} is {value!r}, not an int column index")
            bounds.append(value)
        start, stop = bounds
        if not 0 <= start < stop <= width:
            raise LayoutError(f"{where}: broadcast_columns {self.broadcast_columns} are [{start}, {stop}) on "
                              f"{self.broadcast_linear}'s {width} output features (valid: 0 <= start < stop <= {width})")
        return start, stop

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        super().check_module(module, mesh, fqn)
        self.columns(module, fqn)

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        start, stop = self.columns(module, fqn)
        where = f"{type(self).__name__} on {fqn or '<root>'}: {self.broadcast_linear}"
        group = mesh.get_group()

        def post_hook(mod, inputs, out):
            if isinstance(out, DTensor) or not isinstance(out, torch.Tensor):
                raise LayoutError(f"{where}: expected a plain tensor output (a replicated linear), "
                                  f"got {type(out).__name__}")
            return _ReduceGradColumns.apply(out, start, stop, group)

        record.add_hook(module.get_submodule(self.broadcast_linear).register_forward_hook(post_hook))
        return super().apply(module, mesh, record, fqn)
