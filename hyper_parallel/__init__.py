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

__all__ = [
    "init_device_mesh", "DeviceMesh", "DTensor", "Shard", "Replicate", "Partial", "Placement",
    "distribute_tensor", "distribute_module", "fully_shard",
]
