"""Learn every stage boundary's shapes, dtypes and placements before the first real step.

Receivers must allocate buffers before data arrives. Each rank runs its stages in increasing
order on micro-batch 0 without grad, receiving the input description from the previous stage's
rank and sending its output description on. The chain only ever waits on lower stages, so it
cannot deadlock. The result is cached per input signature; a new signature (dynamic shapes)
repeats it.

``local_boundaries`` gives the same descriptions without any communication, by running every
stage of the model in one process: a dry run on a fake process group (which cannot carry the
exchange to a later stage) hands them to the schedule as ``boundary_metas``.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.core.pipeline_parallel.split import split_model
from hyper_parallel.core.pipeline_parallel.stage import (
    PipelineStage, TensorMeta, dtensor_from_meta, flatten, meta_of,
)
from hyper_parallel.errors import PipelineError


def signature(args: Sequence[Any], kwargs: dict) -> tuple:
    """What decides the shapes: the tensor shapes/dtypes (and placements) of one micro-batch."""
    def one(v):
        if isinstance(v, DTensor):
            return ("dt", tuple(v.shape), v.dtype, tuple(v.placements))
        if isinstance(v, torch.Tensor):
            return ("t", tuple(v.shape), v.dtype)
        return ("o", type(v).__name__)
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _zeros(stage: PipelineStage, m: TensorMeta) -> torch.Tensor:
    t = torch.zeros(m.shape, dtype=m.dtype, device=stage.device)
    if m.placements is None:
        return t
    if stage.activation_mesh is None:
        raise PipelineError(f"stage {stage.stage_index}: receives a DTensor activation but was built "
                            "without activation_mesh")
    return dtensor_from_meta(t, stage.activation_mesh, m)


def infer_boundaries(stages: dict[int, PipelineStage], stage_to_rank: Sequence[int], group,
                     args0: Sequence[Any], kwargs0: dict) -> dict[int, list[TensorMeta]]:
    """{stage s: descriptions of the tensors entering s}, for every s this rank receives into
    or sends out of (the outputs of stage s are under s + 1)."""
    metas: dict[int, list[TensorMeta]] = {}
    outs: dict[int, list[torch.Tensor]] = {}
    n = len(stage_to_rank)
    for s in sorted(stages):
        st = stages[s]
        if s == 0:
            inputs = list(args0)
        elif s - 1 in stages:
            inputs = outs[s - 1]
            metas[s] = [meta_of(t) for t in inputs]
        else:
            box = [None]
            src = dist.get_global_rank(group, stage_to_rank[s - 1]) if group is not None else stage_to_rank[s - 1]
            dist.recv_object_list(box, src=src, group=group, device=torch.device("cpu"))
            metas[s] = box[0]
            inputs = [_zeros(st, m) for m in metas[s]]
        with torch.no_grad():
            out = flatten(st.module(*inputs, **kwargs0), f"stage {s} shape inference")
        outs[s] = out
        metas[s + 1] = [meta_of(t) for t in out]  # what stage s sends = what s + 1 receives
        if s + 1 < n and s + 1 not in stages:
            dst = dist.get_global_rank(group, stage_to_rank[s + 1]) if group is not None else stage_to_rank[s + 1]
            dist.send_object_list([[meta_of(t) for t in out]], dst=dst, group=group,
                                  device=torch.device("cpu"))
    return metas


def local_boundaries(model: torch.nn.Module, cuts: Sequence[str], activation_mesh, args0: Sequence[Any],
                     kwargs0: dict | None = None, device=None) -> dict[int, list[TensorMeta]]:
    """{stage s: descriptions of the tensors entering s} for every stage of ``model`` cut at
    ``cuts``, computed in this process (no communication): every stage is built here and run in
    order on micro-batch 0. ``model`` must carry the same TP layouts as the pipelined model."""
    modules = split_model(model, cuts)
    n = len(modules)
    stages = {s: PipelineStage(m, s, n, group=None, device=device, activation_mesh=activation_mesh)
              for s, m in enumerate(modules)}
    return infer_boundaries(stages, tuple([0] * n), None, args0, kwargs0 or {})
