"""DTensor helpers: placements as data, custom_shard."""
from hyper_parallel.core.dtensor.custom_shard import custom_shard
from hyper_parallel.core.dtensor.placements import (
    layouts_from_data,
    layouts_to_data,
    placement_from_str,
    placement_to_str,
)

__all__ = ["custom_shard", "layouts_from_data", "layouts_to_data", "placement_from_str", "placement_to_str"]
