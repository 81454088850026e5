"""Pipeline parallelism: stage split, schedule IR (generators, validator, simulator), executor."""
from hyper_parallel.core.pipeline_parallel.builder import build_stages
from hyper_parallel.core.pipeline_parallel.generators import (
    build_schedule, gpipe, interleaved_1f1b, one_f_one_b, zbv, zero_bubble_h1,
)
from hyper_parallel.core.pipeline_parallel.graph_split import GraphStageModule, split_graph
from hyper_parallel.core.pipeline_parallel.microbatch import BatchDimSpec, split_microbatches
from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    Action, ActionKind, PipelineSchedule, from_orders, lower,
)
from hyper_parallel.core.pipeline_parallel.schedules import (
    PipelineScheduleRuntime, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBV,
    ScheduleZeroBubble, stage_placement,
)
from hyper_parallel.core.pipeline_parallel.simulator import SimResult, StageCost, simulate
from hyper_parallel.core.pipeline_parallel.split import (
    Spine, StageModule, even_cuts, register_spine, split_model, stage_units, tied_parameters,
)
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.validator import validate_schedule

__all__ = [
    "PipelineStage", "BatchDimSpec", "build_stages", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "ScheduleZeroBubble", "ScheduleZBV", "PipelineScheduleRuntime", "stage_placement",
    "split_model", "split_graph", "GraphStageModule", "even_cuts", "stage_units", "tied_parameters", "StageModule", "Spine",
    "register_spine", "split_microbatches",
    "Action", "ActionKind", "PipelineSchedule", "from_orders", "lower",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "zbv", "build_schedule",
    "validate_schedule", "simulate", "StageCost", "SimResult",
]
