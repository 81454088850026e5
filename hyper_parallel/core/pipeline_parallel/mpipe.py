"""MPipe at run time: the preprocess tower's forward/backward on its owner rank and the gradient sum.

The IR side (which rank runs which tower action, the transposed P2P) is mpipe_ir.py; the
executor calls into :class:`PreprocessState` for PRE_F / PRE_B / REDUCE_PRE and for the tensors
the transposed sends carry. Every pipeline rank holds the whole tower (same initial values, as a
data-parallel replica would): owners differ per micro-batch, so any rank may need it.

Gradients: the tower's parameter gradients of *this step* are summed over the pipeline ranks
(each rank computed the contribution of the micro-batches it owns). Gradients already present
before the step (accumulation over steps) are set aside at the start and added back after the
sum, so they are not multiplied by the number of ranks. With TP inside the tower the sum runs on
the local shards (pipeline peers shard the tower the same way), as for shared parameters. With
data parallel (the runtime's ``dp_group``) the tower is a plain replica on every dp rank too: its
summed gradients are then averaged over the dp group, as FSDP averages the stages'.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hyper_parallel.core.pipeline_parallel.microbatch import BatchDimSpec, split_microbatches
from hyper_parallel.core.pipeline_parallel.stage import TensorMeta, flatten, meta_of
from hyper_parallel.errors import MicrobatchError, PipelineError

log = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class Preprocess:
    """The tower MPipe spreads over the pipeline ranks.

    ``module``: the tower (e.g. ``model.visual``), on every pipeline rank. ``inputs``: the step
    keyword arguments it takes (``("pixel_values",)``), split into micro-batches by ``specs``
    (default: dim 0) and given to it as keywords; every rank that owns a micro-batch must pass
    them. ``into``: the keyword under which stage 0 receives the tower output (a tensor, or a
    tuple when the tower returns one; ``unpack(tensors)``, when given, rebuilds what stage 0 gets
    from the tensors -- image_features.ImageFeatures.unpack). ``keep``: inputs the stages read too
    (Qwen-VL's ``image_grid_thw``: M-RoPE positions), left in the step's keywords. ``placement``:
    see :func:`mpipe_ir.mpipe`.
    """

    module: nn.Module
    inputs: Sequence[str]
    into: str = "vision"
    specs: Mapping[str, BatchDimSpec | int | None] | None = None
    placement: str = "front"
    unpack: Callable[[Sequence[torch.Tensor]], Any] | None = None
    keep: Sequence[str] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.module, nn.Module):
            raise PipelineError(f"Preprocess: module must be an nn.Module, got {type(self.module).__name__}")
        if isinstance(self.inputs, str) or not self.inputs or not all(isinstance(n, str) for n in self.inputs):
            raise PipelineError(f"Preprocess: inputs={self.inputs!r} must be a non-empty sequence of keyword "
                                "names, e.g. ('pixel_values',)")
        if not isinstance(self.into, str) or not self.into:
            raise PipelineError(f"Preprocess: into={self.into!r} must be a keyword name, e.g. 'vision'")
        if any(isinstance(m, FSDPModule) for m in self.module.modules()):
            raise PipelineError("Preprocess: an FSDP-wrapped tower is not supported (MPipe reduces the tower's "
                                "gradients over the pipeline ranks itself); shard the tower with TP or keep it whole")
        self.inputs = tuple(self.inputs)
        self.keep = tuple(self.keep)
        if set(self.keep) - set(self.inputs):
            raise PipelineError(f"Preprocess: keep={list(self.keep)} names keywords that are not inputs "
                                f"{list(self.inputs)}")
        unknown = set(self.specs or {}) - set(self.inputs)
        if unknown:
            raise PipelineError(f"Preprocess: specs name {sorted(unknown)}, which are not inputs {list(self.inputs)}")


@dataclass
class PreprocessState:
    """One step of the tower on this rank: per micro-batch inputs, outputs (graph kept), grads."""

    pre: Preprocess
    mb_inputs: list[dict[str, Any] | None]
    outputs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    metas: list[TensorMeta] | None = None
    dp_group: Any = None
    _saved: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def begin(cls, pre: Preprocess, kwargs: dict, n_mb: int, dp_group=None) -> "PreprocessState":
        """Take the tower inputs out of the step's ``kwargs`` (in place), split them, and set
        this rank's existing tower gradients aside."""
        given = {k: (kwargs[k] if k in pre.keep else kwargs.pop(k)) for k in pre.inputs if k in kwargs}
        if given and len(given) != len(pre.inputs):
            raise MicrobatchError(f"MPipe: the tower takes {list(pre.inputs)}; got only {sorted(given)}")
        mb_inputs: list = [None] * n_mb
        if given:
            # an uneven split is refused there: every micro-batch's tower output has one shape, so
            # stage 0 can allocate every transposed receive from micro-batch 0's
            _, parts = split_microbatches((), given, n_mb, None, pre.specs)
            mb_inputs = parts
        st = cls(pre, mb_inputs, dp_group=dp_group)
        for p in pre.module.parameters():
            if p.grad is not None:
                st._saved[id(p)] = p.grad
                p.grad = None
        return st

    def inputs_of(self, mb: int) -> dict[str, Any]:
        got = self.mb_inputs[mb]
        if got is None:
            raise MicrobatchError(f"MPipe: this rank owns micro-batch {mb}'s tower but the step got none of "
                                  f"{list(self.pre.inputs)}; pass them on every pipeline rank")
        return got

    def forward(self, mb: int) -> list[torch.Tensor]:
        out = flatten(self.pre.module(**self.inputs_of(mb)), f"MPipe tower micro-batch {mb}")
        self.outputs[mb] = out
        metas = [meta_of(t) for t in out]
        if self.metas is None:
            self.metas = metas
        elif [(m.shape, m.dtype, m.requires_grad) for m in metas] != \
                [(m.shape, m.dtype, m.requires_grad) for m in self.metas]:
            raise PipelineError(f"MPipe: tower output of micro-batch {mb} is {metas}, micro-batch 0's was "
                                f"{self.metas}; every micro-batch must give the same shapes")
        return out

    def backward(self, mb: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Tower backward of micro-batch mb from the gradients of its outputs (None: no gradient)."""
        outs = self.outputs.pop(mb)
        if len(grads) != len(outs):
            raise PipelineError(f"MPipe: micro-batch {mb}: {len(grads)} gradients for {len(outs)} tower outputs")
        pairs = []
        for o, g in zip(outs, grads):
            if not o.requires_grad or g is None:
                continue
            if isinstance(o, DTensor) and not isinstance(g, DTensor):
                g = DTensor.from_local(g, o.device_mesh, o.placements, run_check=False, shape=o.shape,
                                       stride=o.stride())
            elif isinstance(o, DTensor) and tuple(g.placements) != tuple(o.placements):
                g = g.redistribute(o.device_mesh, o.placements)
            pairs.append((o, g))
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], grad_tensors=[p[1] for p in pairs])

    def reduce(self, group) -> None:
        """Sum this step's tower gradients over the pipeline ranks (one all-reduce per dtype over
        the flattened local shards), then add back the set-aside ones."""
        if self.outputs:
            raise PipelineError(f"MPipe: tower micro-batches {sorted(self.outputs)} never ran their backward")
        params = [p for p in self.pre.module.parameters() if p.requires_grad]
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(_local(p).dtype, []).append(p)
        for dtype, ps in by_dtype.items():
            flat = torch.cat([(_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))).reshape(-1)
                              for p in ps])
            if dist.is_initialized():
                dist.all_reduce(flat, group=group)
                if self.dp_group is not None:
                    dist.all_reduce(flat, group=self.dp_group)
                    flat /= dist.get_world_size(self.dp_group)
            offset = 0
            for p in ps:
                n = _local(p).numel()
                buf = flat[offset:offset + n].view(_local(p).shape).clone()
                offset += n
                saved = self._saved.pop(id(p), None)
                if saved is not None:
                    buf += _local(saved)
                p.grad = DTensor.from_local(buf, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride()) if isinstance(p, DTensor) else buf


def tower_reduce_bytes(module: nn.Module) -> dict[torch.dtype, int]:
    """Bytes of REDUCE_PRE's all-reduce(s) on this rank, per dtype: the local shards of the
    tower's trainable parameters (what verify predicts)."""
    out: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.requires_grad:
            t = _local(p)
            out[t.dtype] = out.get(t.dtype, 0) + t.numel() * t.element_size()
    return out
