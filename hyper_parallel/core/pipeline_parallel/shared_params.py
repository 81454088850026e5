"""Parameters that several stages hold (a tied embedding and LM head): one value, one gradient.

Every copy starts from the value on the lowest stage that holds it (broadcast over the pipeline
group) and, after each step, every copy's gradient becomes the sum over copies (all-reduce over
the pipeline group, ranks without a copy contributing zeros; a rank holding two stages that share
the very same Parameter contributes its gradient once). Works on the local shards of DTensor
parameters: pipeline peers shard a parameter the same way, so shards line up. With data parallel,
shared parameters stay out of FSDP and their gradients are also averaged over the dp group.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.errors import PipelineError


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class SharedParameters:
    """The tied groups of one pipeline, bound to this rank's stages."""

    def __init__(self, groups: Sequence[dict[int, str]], stages: dict[int, PipelineStage],
                 stage_to_rank: Sequence[int], group, dp_group=None):
        self.group = group
        self.dp_group = dp_group
        self.stage_to_rank = tuple(stage_to_rank)
        # the large-model path builds every rank's stages on meta and gives them values later
        # (hyper_parallel.core.materialize / a pretrained checkpoint), so every rank agrees on this
        self.on_meta = any(p.is_meta for st in stages.values() for p in st.module.parameters())
        self.entries = []  # (group index, owner pp rank, local unique params)
        described = []
        for gi, holders in enumerate(groups):
            params = []
            for s, fqn in sorted(holders.items()):
                if s in stages:
                    try:
                        p = stages[s].module.get_parameter(fqn)
                    except AttributeError as e:
                        raise PipelineError(f"shared parameter {fqn!r} is not in stage {s}'s module") from e
                    if all(p is not q for q in params):
                        params.append(p)
            desc = (tuple(_local(params[0]).shape), _local(params[0]).dtype) if params else None
            described.append(desc)
            owner = self.stage_to_rank[min(holders)]
            self.entries.append((gi, owner, params))
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, described, group=group)
        if all(d is None for d in gathered):
            # nothing came back, not even this rank's own list: a fake process group (a dry run).
            # Pipeline peers shard a parameter alike, so this rank's copies describe the group; a
            # group it holds no copy of stays unknown and fails below, naming it
            gathered = [described]
        self.shapes = []
        for gi in range(len(groups)):
            seen = {d[gi] for d in gathered if d[gi] is not None}
            if len(seen) != 1:
                raise PipelineError(f"shared parameter group {groups[gi]}: local shapes differ across "
                                    f"pipeline ranks: {sorted(map(str, seen))}")
            self.shapes.append(seen.pop())

    def _global(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.group, pp_rank) if self.group is not None else pp_rank

    def broadcast_values(self, device) -> None:
        """Make every copy equal to the lowest holding stage's value. Stages still on meta have
        no values to send: materialising gives each copy its owner's (``InitSources``: one init
        per tied group, drawn under the owner's name) and a checkpoint stores it once, under the
        owner's name -- and a meta buffer on the owner beside a real one on a receiver would leave
        the broadcast unmatched (a V schedule puts both copies on one rank, the others hold none)."""
        if self.on_meta:
            return
        for (gi, owner, params), (shape, dtype) in zip(self.entries, self.shapes):
            buf = _local(params[0]).detach().clone() if params else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(buf, src=self._global(owner), group=self.group)
            with torch.no_grad():
                for p in params:
                    _local(p).copy_(buf)

    def reduce_grads(self, device) -> None:
        """Sum the gradient of every copy and give the sum to each."""
        for (gi, owner, params), (shape, dtype) in zip(self.entries, self.shapes):
            buf = torch.zeros(shape, dtype=dtype, device=device)
            for p in params:
                if p.grad is not None:
                    buf += _local(p.grad)
            dist.all_reduce(buf, group=self.group)
            if self.dp_group is not None:
                dist.all_reduce(buf, group=self.dp_group)
                buf /= dist.get_world_size(self.dp_group)
            for p in params:
                if p.grad is None:
                    # on the parameter's own device (a dry run keeps parameters on meta beside fake buffers)
                    grad = buf.clone().to(_local(p).device)
                    p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride()) \
                        if isinstance(p, DTensor) else grad
                else:
                    _local(p.grad).copy_(buf)
