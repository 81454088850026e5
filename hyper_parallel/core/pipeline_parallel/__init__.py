"""Pipeline parallelism: stage split, schedule IR (generators, validator, simulator), executor.

    stages = build_stages(model, Schedule1F1B.ir(pp, m), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stages, m, loss_fn)
    loss = schedule.step(tokens, target=labels)      # mean micro-batch loss on the last stage

The planner times the same IR without torch state, and reads every per-schedule fact (stages per
rank, split backward, in-flight micro-batches, bubble) from ``schedule_facts``:
    simulate(build_schedule("1F1B", pp, m), StageCost(f, b_input, b_weight), p2p_time)
"""
from hyper_parallel.core.pipeline_parallel.builder import build_stages
from hyper_parallel.core.pipeline_parallel.generators import (
    gpipe, interleaved_1f1b, one_f_one_b, zbv, zero_bubble_h1,
)
from hyper_parallel.core.pipeline_parallel.microbatch import BatchDimSpec, PerMicrobatch, split_microbatches
from hyper_parallel.core.pipeline_parallel.mpipe import Preprocess
from hyper_parallel.core.pipeline_parallel.mpipe_ir import mpipe
from hyper_parallel.core.pipeline_parallel.schedule_ir import (
    Action, ActionKind, PipelineSchedule, from_orders, lower, preprocess_owner,
)
from hyper_parallel.core.pipeline_parallel.schedules import (
    PipelineScheduleRuntime, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZBV,
    ScheduleZeroBubble, stage_placement,
)
from hyper_parallel.core.pipeline_parallel.schedule_facts import (
    SCHEDULE_NAMES, SCHEDULES, ScheduleFacts, build_schedule, schedule_facts,
)
from hyper_parallel.core.pipeline_parallel import image_features
from hyper_parallel.core.pipeline_parallel.forward_split import STAGE_TOKENS
from hyper_parallel.core.pipeline_parallel.image_features import ImageFeatures
from hyper_parallel.core.pipeline_parallel.simulator import SimResult, StageCost, simulate
from hyper_parallel.core.pipeline_parallel.split import (
    Spine, StageModule, even_cuts, pipeline_units, prepare_split, register_spine, split_gap, split_model,
    stage_units, tied_parameters,
)
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from hyper_parallel.core.pipeline_parallel.validator import validate_schedule

__all__ = [
    # runtime
    "PipelineStage", "BatchDimSpec", "PerMicrobatch", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "ScheduleZeroBubble", "ScheduleZBV", "PipelineScheduleRuntime", "build_stages", "stage_placement",
    "split_microbatches", "Preprocess", "ImageFeatures", "image_features", "STAGE_TOKENS",
    # stage split
    "split_model", "even_cuts", "pipeline_units", "prepare_split", "split_gap", "stage_units", "tied_parameters", "StageModule",
    "Spine", "register_spine",
    # schedule IR, generators, validator, simulator (torch-free)
    "Action", "ActionKind", "PipelineSchedule", "from_orders", "lower",
    "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "zbv", "build_schedule",
    "validate_schedule", "simulate", "StageCost", "SimResult", "mpipe", "preprocess_owner",
    # the table of per-schedule facts the planner and the cost model read
    "SCHEDULES", "SCHEDULE_NAMES", "ScheduleFacts", "schedule_facts",
]
