"""FSDP inside the pipeline: what UNSHARD / RESHARD / REDUCE_GRAD do to a fully_shard'ed stage.

A stage runs many micro-batch backwards per step; FSDP must accumulate unsharded gradients across
them and reduce-scatter once, after the last. So before the step every FSDP module of a stage is
told not to sync or reshard after backward, and REDUCE_GRAD runs FSDP's post-backward for each of
its parameter groups by hand (the same steps torch.distributed.pipelining takes).
"""
from __future__ import annotations

from typing import Callable

from torch.distributed.fsdp import FSDPModule, fully_shard

from hyper_parallel.core.pipeline_parallel.stage import PipelineStage


def _fsdp_modules(stage: PipelineStage) -> list[FSDPModule]:
    return [m for m in stage.module.modules() if isinstance(m, FSDPModule)]


def has_fsdp(stages: dict[int, PipelineStage]) -> bool:
    return any(_fsdp_modules(s) for s in stages.values())


def prepare_fsdp_backward(stages: dict[int, PipelineStage]) -> None:
    for s in stages.values():
        for m in _fsdp_modules(s):
            m.set_is_last_backward(False)
            m.set_requires_gradient_sync(False)
            m.set_reshard_after_backward(False)


def _reduce(stage: PipelineStage) -> None:
    root = stage.module
    if not isinstance(root, FSDPModule):
        return
    for m in _fsdp_modules(stage):
        m.set_is_last_backward(True)
        m.set_requires_gradient_sync(True)
        m.set_reshard_after_backward(True)
    state = fully_shard.state(root)
    for sub in state._state_ctx.all_states:
        for group in sub._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def fsdp_hooks(stages: dict[int, PipelineStage]) -> dict[str, Callable[[int], None]]:
    """Handlers for the IR's FSDP actions, keyed by ActionKind value."""
    def unshard(s: int) -> None:
        if isinstance(stages[s].module, FSDPModule):
            stages[s].module.unshard()

    def reshard(s: int) -> None:
        for m in _fsdp_modules(stages[s]):
            m.reshard()

    return {"UNSHARD": unshard, "RESHARD": reshard, "REDUCE_GRAD": lambda s: _reduce(stages[s])}
