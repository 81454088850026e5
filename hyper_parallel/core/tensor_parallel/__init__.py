"""Tensor and sequence parallel styles, parallelize_module and loss parallel."""
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle
from hyper_parallel.core.tensor_parallel.head_styles import PrepareHeadsInput
from hyper_parallel.core.tensor_parallel.kv_styles import KVReplicatedParallel
from hyper_parallel.core.tensor_parallel.latent_styles import PrepareLatentInput
from hyper_parallel.core.tensor_parallel.linear_styles import ColwiseParallel, RowwiseParallel
from hyper_parallel.core.tensor_parallel.loss import loss_parallel, vocab_parallel_cross_entropy
from hyper_parallel.core.tensor_parallel.parallelize import flatten_plan, match_modules, parallelize_module
from hyper_parallel.core.tensor_parallel.prepare_styles import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
from hyper_parallel.core.tensor_parallel.replicate_styles import NoParallel, SequenceParallel
from hyper_parallel.core.tensor_parallel.torch_native import to_torch_plan, to_torch_style
from hyper_parallel.core.tensor_parallel.uneven_heads import HeadColsParallel, HeadRowsParallel

__all__ = [
    "ApplyRecord", "ParallelStyle", "KVReplicatedParallel", "HeadRowsParallel", "HeadColsParallel", "PrepareLatentInput", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "NoParallel",
    "PrepareModuleInput", "PrepareHeadsInput", "PrepareModuleOutput", "PrepareModuleInputOutput", "parallelize_module",
    "flatten_plan", "match_modules", "loss_parallel", "vocab_parallel_cross_entropy",
    "to_torch_plan", "to_torch_style",
]
