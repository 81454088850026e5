"""PipelineStage: one stage's module plus the per-micro-batch state the schedule needs.

The stage runs forward and the three backward flavours for one micro-batch at a time:
- ``full`` (B): one backward pass, input and parameter gradients together;
- ``input`` (I, dx): only the gradient of the stage input, graph kept for the weight pass;
- ``weight`` (W, dw): the parameter gradients, from gradients the I pass recorded at the nodes
  where parameters join the dx path (see weight_grad.py), so W does only weight work. Where that
  does not apply (the first stage, whose input needs no gradient; FSDP stages, whose reduction
  hangs off an ordinary backward) W is a plain backward over the kept graph.
Inputs received from another stage become fresh leaves, so each stage's graph ends at its input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hyper_parallel.core.dtensor.fsdp_outputs import read_only_output
from hyper_parallel.core.pipeline_parallel.weight_grad import input_backward
from hyper_parallel.errors import PipelineError
from hyper_parallel.platform import device_type


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate a buffer: shape/dtype of the local tensor, and the
    placements if the sender's tensor was a DTensor (None otherwise)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    placements: tuple | None = None
    global_shape: tuple[int, ...] | None = None


def dtensor_from_meta(local: torch.Tensor, mesh, meta: TensorMeta) -> torch.Tensor:
    """Rebuild a received DTensor activation: local data, the sender's placements, global shape."""
    shape = torch.Size(meta.global_shape)
    stride, acc = [], 1
    for d in reversed(shape):
        stride.append(acc)
        acc *= d
    return DTensor.from_local(local, mesh, meta.placements, run_check=False, shape=shape,
                              stride=tuple(reversed(stride)))


def flatten(value: Any, where: str) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    raise PipelineError(f"{where}: stage outputs must be a tensor or a tuple of tensors, got "
                        f"{type(value).__name__}")


def meta_of(t: torch.Tensor) -> TensorMeta:
    if isinstance(t, DTensor):
        return TensorMeta(tuple(t.to_local().shape), t.dtype, t.requires_grad, tuple(t.placements),
                          tuple(t.shape))
    return TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)


def local_of(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor to put on the wire: the local shard of a DTensor in the placements of ``like``."""
    if isinstance(t, DTensor):
        if isinstance(like, DTensor) and tuple(t.placements) != tuple(like.placements):
            t = t.redistribute(like.device_mesh, like.placements)
        return t.to_local().contiguous()
    return t.contiguous()


def _like(g: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """An input gradient in the placements of the input (a DTensor grad may come back Partial)."""
    if isinstance(g, DTensor) and isinstance(x, DTensor) and tuple(g.placements) != tuple(x.placements):
        return g.redistribute(x.device_mesh, x.placements)
    return g


class PipelineStage:
    """A stage of the pipeline living on this rank.

    ``group`` is the pipeline process group (the ``pp`` dimension of a mesh); ``activation_mesh``
    is the mesh that DTensor activations arriving at this stage live on (the ``tp`` submesh).
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int,
                 group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 activation_mesh=None):
        if not 0 <= stage_index < num_stages:
            raise PipelineError(f"PipelineStage: stage_index {stage_index} is outside 0..{num_stages - 1}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group
        self.device = torch.device(device or device_type())
        self.activation_mesh = activation_mesh
        self.clear()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def clear(self) -> None:
        """Drop every micro-batch's saved state (start of a step)."""
        # FSDP reduces gradients from its own backward hooks, so its stages take the plain W path;
        # looked up every step because fully_shard may be applied after the stage is built
        self._split_weights = not any(isinstance(m, FSDPModule) for m in self.module.modules())
        self._inputs: dict[int, list[Any]] = {}
        self._roots: dict[int, tuple[list[torch.Tensor], list[torch.Tensor] | None]] = {}
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.input_grads: dict[int, list[torch.Tensor | None]] = {}
        self._pending_w: dict[int, tuple] = {}
        # MPipe (stage 0 only): the tower output as leaves, and the gradients they collect
        self._pre: dict[int, list[torch.Tensor]] = {}
        self.pre_grads: dict[int, list[torch.Tensor | None]] = {}

    def leaf_inputs(self, values: Sequence[Any]) -> list[Any]:
        """Detach received tensors into leaves that collect the input gradient."""
        out = []
        for v in values:
            if isinstance(v, torch.Tensor):
                v = v.detach()
                if v.is_floating_point():
                    v.requires_grad_(True)
            out.append(v)
        return out

    def forward(self, mb: int, args: Sequence[Any], kwargs: dict,
                pre: tuple | None = None) -> list[torch.Tensor]:
        """``pre`` (MPipe, stage 0): (keyword, tower output tensors, which need a gradient[, how to
        unpack them -- Preprocess.unpack]); they
        enter as fresh leaves, so the tower's graph stays on its owner and ``pre_grads[mb]`` gets
        the gradient of each (None where none is needed) at the B or I of this micro-batch."""
        inputs = list(args) if self.is_first else self.leaf_inputs(args)
        if pre is not None:
            into, tensors, needs_grad, *unpack = pre
            leaves = [t.detach().requires_grad_(bool(g)) for t, g in zip(tensors, needs_grad)]
            self._pre[mb] = leaves
            value = unpack[0](leaves) if unpack and unpack[0] is not None else \
                (leaves[0] if len(leaves) == 1 else tuple(leaves))
            kwargs = {**kwargs, into: value}
        read_only_output(self.module)   # sent on or kept for backward, never modified
        out = self.module(*inputs, **kwargs)
        flat = flatten(out, f"stage {self.stage_index} micro-batch {mb}")
        self._inputs[mb] = inputs
        self.outputs[mb] = flat
        return flat

    def set_loss(self, mb: int, loss: torch.Tensor) -> None:
        """On the last stage: backward starts from the (scaled) loss instead of the outputs."""
        self._roots[mb] = ([loss], None)

    def backward(self, mb: int, grad_outputs: list[torch.Tensor] | None, mode: str = "full") -> None:
        if mb not in self._inputs:
            raise PipelineError(f"stage {self.stage_index}: backward of micro-batch {mb} before its forward")
        if mode == "weight":
            if mb not in self._pending_w:
                raise PipelineError(f"stage {self.stage_index}: weight backward of micro-batch {mb} "
                                    "before its input backward")
            roots, grads, deferred = self._pending_w.pop(mb)
        elif self.is_last and mb in self._roots:
            roots, grads = self._roots[mb]
        else:
            roots, grads = self.outputs[mb], self._wrap_grads(mb, grad_outputs)
            pairs = [(r, g) for r, g in zip(roots, grads) if r.requires_grad]
            roots, grads = [p[0] for p in pairs], [p[1] for p in pairs]
        inputs = self._inputs[mb]
        pre = self._pre.get(mb, [])
        needs = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        n_inputs = len(needs)
        needs += [x for x in pre if x.requires_grad]
        if mode == "full":
            if roots:
                torch.autograd.backward(roots, grad_tensors=grads)
            self.input_grads[mb] = [_like(x.grad, x) if isinstance(x, torch.Tensor) else None
                                    for x in inputs]
            if pre:
                self.pre_grads[mb] = [_like(x.grad, x) if x.requires_grad else None for x in pre]
            self._free(mb)
        elif mode == "input":
            deferred = None
            if needs and roots and self._split_weights:
                got, deferred = input_backward(roots, grads, needs, list(self.module.parameters()))
            elif needs and roots:
                got = torch.autograd.grad(roots, needs, grad_outputs=grads, retain_graph=True,
                                          allow_unused=True)
            else:
                got = [None] * len(needs)
            self._pending_w[mb] = (roots, grads, deferred)
            it = iter(got[:n_inputs])
            self.input_grads[mb] = [_like(next(it), x) if (isinstance(x, torch.Tensor) and x.requires_grad)
                                    else None for x in inputs]
            if pre:
                it = iter(got[n_inputs:])
                self.pre_grads[mb] = [_like(next(it), x) if x.requires_grad else None for x in pre]
        elif mode == "weight":
            if deferred is not None:
                deferred.run()
            elif roots:
                torch.autograd.backward(roots, grad_tensors=grads)
            self._free(mb)
        else:
            raise PipelineError(f"stage {self.stage_index}: unknown backward mode {mode!r}")

    def _wrap_grads(self, mb: int, grads: list[torch.Tensor] | None) -> list[torch.Tensor]:
        outs = self.outputs[mb]
        if grads is None or len(grads) != len(outs):
            raise PipelineError(f"stage {self.stage_index} micro-batch {mb}: got "
                                f"{0 if grads is None else len(grads)} output gradients for {len(outs)} outputs")
        wrapped = []
        for o, g in zip(outs, grads):
            if isinstance(o, DTensor) and g is not None and not isinstance(g, DTensor):
                g = DTensor.from_local(g, o.device_mesh, o.placements, run_check=False,
                                       shape=o.shape, stride=o.stride())
            wrapped.append(g)
        return wrapped

    def _free(self, mb: int) -> None:
        self._inputs.pop(mb, None)
        self._pre.pop(mb, None)
        self._roots.pop(mb, None)
        self.outputs.pop(mb, None)

    def scale_grads(self, factor: float) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                p.grad.mul_(factor)
