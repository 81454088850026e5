"""hyper_parallel: the runtime that applies parallel plans (tensor, sequence, pipeline, FSDP).

DTensor, DeviceMesh and FSDP2 are torch's and re-exported here; the parallel styles,
parallelize_module, loss parallel, custom_shard and the pipeline runtime are ours.
"""
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

from hyper_parallel.core.collective import Collective
from hyper_parallel.core.dtensor import custom_shard
from hyper_parallel.core.pipeline_parallel import (
    BatchDimSpec,
    PipelineSchedule,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBV,
    ScheduleZeroBubble,
    SimResult,
    StageCost,
    build_schedule,
    build_stages,
    simulate,
    split_model,
    validate_schedule,
)
from hyper_parallel.core.tensor_parallel import (
    ColwiseParallel,
    HeadColsParallel,
    HeadRowsParallel,
    NoParallel,
    ParallelStyle,
    KVReplicatedParallel,
    PrepareHeadsInput,
    PrepareLatentInput,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
    vocab_parallel_cross_entropy,
)
from hyper_parallel.core.expert_parallel import (
    DenseExpertsParallel,
    FlatExpertsParallel,
    PairedExpertsParallel,
    ExpertParallel,
    balanced_routing,
    expert_parallel_collectives,
)
from hyper_parallel.core.context_parallel import (
    ContextParallel,
    apply_context_parallel,
    average_gradients,
    cp_cross_entropy,
    local_positions,
    shard_batch,
    unshard_sequence,
)
from hyper_parallel.core.style_registry import style_from_dict
from hyper_parallel.parallel_dims import ParallelDims

__all__ = [
    "ParallelDims", "Collective",
    "init_device_mesh", "DeviceMesh", "DTensor", "Shard", "Replicate", "Partial", "Placement",
    "distribute_tensor", "distribute_module", "fully_shard", "custom_shard",
    "parallelize_module", "ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel",
    "PrepareModuleInput", "PrepareHeadsInput", "KVReplicatedParallel", "PrepareModuleOutput", "PrepareModuleInputOutput", "NoParallel",
    "PrepareLatentInput", "HeadRowsParallel", "HeadColsParallel",
    "loss_parallel", "vocab_parallel_cross_entropy", "style_from_dict",
    "PipelineStage", "BatchDimSpec", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
    "ScheduleZeroBubble", "ScheduleZBV", "ExpertParallel", "DenseExpertsParallel", "FlatExpertsParallel",
    "PairedExpertsParallel", "balanced_routing",
    "expert_parallel_collectives", "split_model", "build_stages",
    "PipelineSchedule", "validate_schedule", "simulate", "StageCost", "SimResult", "build_schedule",
    "ContextParallel", "apply_context_parallel", "shard_batch", "unshard_sequence", "local_positions",
    "cp_cross_entropy", "average_gradients",
]
