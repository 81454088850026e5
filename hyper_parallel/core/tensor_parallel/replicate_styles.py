"""Styles that keep parameters whole: SequenceParallel and NoParallel.

SequenceParallel runs a module whose math is per-token (norms, dropout) on a sequence shard:
parameters are replicated DTensors. Their gradients come out of backward as Partial sums, as in
torch (the optimizer's first DTensor op reduces them); ``reduce_grads=True`` reduces them in
backward instead (one all-reduce per weight), which autoplan's runners choose so that every
gradient carries its parameter's layout when backward ends (the planner's collective counts,
verify's dry run and the pipeline's weight pass assume it).
NoParallel keeps a module entirely replicated inside a tensor-parallel region (a MoE router,
a norm without SP): its inputs are annotated and, if needed, gathered, so that it can sit
between sharded neighbours and still appear in a plan as an explicit decision.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from hyper_parallel.core.tensor_parallel.base import (
    KEEP_PARTIAL_GRADS,
    ApplyRecord,
    ParallelStyle,
    shard_params,
    to_dtensor,
)
from hyper_parallel.errors import LayoutError


def _map_tensor_args(inputs: tuple, fn) -> tuple:
    return tuple(fn(x) if isinstance(x, torch.Tensor) else x for x in inputs)


class SequenceParallel(ParallelStyle):
    """Replicated parameters, input and output sharded on ``sequence_dim``.

    A local input is taken to be the sequence shard already; a DTensor input in another layout
    is redistributed. The output stays a DTensor unless ``use_local_output``. ``reduce_grads``:
    all-reduce the (Partial) weight gradients in backward rather than leave them to the optimizer
    (torch's behaviour, the default).
    """

    _args = {"sequence_dim": 1, "use_local_output": False, "reduce_grads": False}

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False, reduce_grads: bool = False):
        if not isinstance(sequence_dim, int) or isinstance(sequence_dim, bool):
            raise LayoutError(f"SequenceParallel: sequence_dim must be an int, got {sequence_dim!r}")
        self.sequence_dim = sequence_dim
        self.use_local_output = bool(use_local_output)
        self.reduce_grads = bool(reduce_grads)

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        where = f"SequenceParallel on {fqn or '<root>'}"
        shard_params(module, mesh, record, {}, Replicate(), fqn, recurse=True)
        if not self.reduce_grads:
            for sub in module.modules():
                if sub._parameters:
                    record.add_flag(sub, KEEP_PARTIAL_GRADS)
        seq = Shard(self.sequence_dim)

        def pre_hook(mod, inputs):
            if not any(isinstance(x, torch.Tensor) for x in inputs):
                raise LayoutError(f"{where}: expected a tensor input, got {len(inputs)} non-tensor inputs")
            return _map_tensor_args(inputs, lambda x: to_dtensor(x, mesh, seq, seq, where))

        def post_hook(mod, inputs, out):
            if self.use_local_output and isinstance(out, DTensor):
                return out.to_local()
            return out

        record.add_hook(module.register_forward_pre_hook(pre_hook))
        record.add_hook(module.register_forward_hook(post_hook))
        return module


class NoParallel(ParallelStyle):
    """Keep a module replicated in a TP region: replicated DTensor parameters, tensor inputs
    annotated as ``input_layouts`` and moved to ``desired_input_layouts``, the output moved to
    ``output_layouts`` (and returned as a local tensor when ``use_local_output``)."""

    _args = {"input_layouts": Replicate(), "desired_input_layouts": Replicate(),
             "output_layouts": Replicate(), "use_local_output": True}
    _layout_args = frozenset({"input_layouts", "desired_input_layouts", "output_layouts"})

    def __init__(self, *, input_layouts: Placement = Replicate(), desired_input_layouts: Placement = Replicate(),
                 output_layouts: Placement = Replicate(), use_local_output: bool = True):
        for name, value in (("input_layouts", input_layouts), ("desired_input_layouts", desired_input_layouts),
                            ("output_layouts", output_layouts)):
            if not isinstance(value, Placement):
                raise LayoutError(f"NoParallel: {name} must be one Placement, got {value!r}")
        self.input_layouts = input_layouts
        self.desired_input_layouts = desired_input_layouts
        self.output_layouts = output_layouts
        self.use_local_output = bool(use_local_output)

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        where = f"NoParallel on {fqn or '<root>'}"
        shard_params(module, mesh, record, {}, Replicate(), fqn, recurse=True)

        def pre_hook(mod, inputs):
            return _map_tensor_args(
                inputs, lambda x: to_dtensor(x, mesh, self.input_layouts, self.desired_input_layouts, where)
            )

        def fix(out):
            if isinstance(out, DTensor):
                if out.placements != (self.output_layouts,):
                    out = out.redistribute(placements=(self.output_layouts,))
                return out.to_local() if self.use_local_output else out
            return out

        def post_hook(mod, inputs, out):
            if isinstance(out, tuple):
                return tuple(fix(o) for o in out)
            return fix(out)

        record.add_hook(module.register_forward_pre_hook(pre_hook))
        record.add_hook(module.register_forward_hook(post_hook))
        return module
