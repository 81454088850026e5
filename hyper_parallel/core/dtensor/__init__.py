"""DTensor helpers: placements as data, custom_shard."""
from hyper_parallel.core.dtensor.custom_shard import custom_shard
from hyper_parallel.core.dtensor.fsdp_placement import fsdp_shard_placement, fsdp_unshardable, strided_dims
from hyper_parallel.core.dtensor.placements import (
    layouts_from_data,
    layouts_to_data,
    placement_from_str,
    placement_to_str,
)

__all__ = ["custom_shard", "fsdp_shard_placement", "fsdp_unshardable", "strided_dims", "layouts_from_data", "layouts_to_data", "placement_from_str", "placement_to_str"]
