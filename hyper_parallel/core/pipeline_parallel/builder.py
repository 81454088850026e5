"""From a model to this rank's PipelineStages in one call: split at cuts, pick the stages the
schedule places on this pipeline rank, wrap them."""
from __future__ import annotations

from typing import Sequence

import torch.distributed as dist
import torch.nn as nn

from hyper_parallel.core.pipeline_parallel.schedule_ir import PipelineSchedule
from hyper_parallel.core.pipeline_parallel.split import even_cuts, split_model
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.errors import StageSplitError


def build_stages(model: nn.Module, schedule: PipelineSchedule, group=None,
                 cuts: Sequence[str] | None = None, device=None, activation_mesh=None,
                 side: bool = True) -> list[PipelineStage]:
    """This pipeline rank's stages of ``model`` for ``schedule`` (an IR, e.g. ``Schedule1F1B.ir(p, m)``).

    ``cuts`` default to :func:`even_cuts` for the schedule's stage count. ``side``: stage 0 holds
    a VL model's tower (False when MPipe runs it: split.stage_units).
    """
    n = schedule.n_stages
    cuts = even_cuts(model, n) if cuts is None else list(cuts)
    if len(cuts) != n - 1:
        raise StageSplitError(f"build_stages: {schedule.name} has {n} stages, so it needs {n - 1} cuts; "
                              f"got {len(cuts)}: {cuts}")
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    mine = schedule.stages_of(rank)
    modules = split_model(model, cuts, mine, side)
    return [PipelineStage(m, s, n, group=group, device=device, activation_mesh=activation_mesh)
            for s, m in zip(mine, modules)]
