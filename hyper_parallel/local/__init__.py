"""Running on this host: what the demo, the planner's probe, verify, training and calibration use
to run the runtime without a cluster.

- ``rank_pool``: ``RankPool`` (local gloo ranks that start their process group once and run many
  functions), ``free_port``
- ``fake_world``: torch's fake process group at any world size, for dry runs on one CPU
- ``isolated_world``: a c10d world of its own for a block, beside a launched job's groups (what
  lets ``fake_world`` start inside a job)
- ``dtensor_caches``: ``clear_dtensor_caches``, DTensor's sharding caches emptied between worlds
- ``meshes``: ``cached_mesh``, one DeviceMesh per shape per process
- ``collectives``: ``CollectiveRecorder``, every collective a block issues, in the plan vocabulary
- ``gather``: ``full``, ``grads_by_name``: DTensors gathered to whole tensors for comparisons

Test-only helpers (``compare_steps``, per-module CommDebugMode counts) stay in
``hyper_parallel.testing``, which library code does not import.
"""
from hyper_parallel.local.collectives import CollectiveRecorder, kind_of
from hyper_parallel.local.dtensor_caches import clear_dtensor_caches
from hyper_parallel.local.fake_world import fake_world
from hyper_parallel.local.gather import full, grads_by_name
from hyper_parallel.local.isolated_world import isolated_world
from hyper_parallel.local.meshes import cached_mesh
from hyper_parallel.local.rank_pool import RankPool, free_port

__all__ = ["CollectiveRecorder", "RankPool", "cached_mesh", "clear_dtensor_caches", "fake_world", "free_port", "full",
           "grads_by_name", "isolated_world", "kind_of"]
