"""autoplan: automatic parallelization plans for PyTorch training.

    plan = autoplan(model, mesh, batch=(global_batch, seq_len))
    plan.to_json("plan.json")
    runner = plan.apply(model, device_mesh)
"""
from autoplan.api import autoplan
from autoplan.cluster import plan_cluster
from autoplan.plan import Plan
from autoplan.review.compare import compare_plans
from hyper_parallel.parallel_dims import ParallelDims

# the mesh a plan is made for: the runtime's ParallelDims, under the name autoplan's API has always used
MeshSpec = ParallelDims

__all__ = ["autoplan", "plan_cluster", "Plan", "MeshSpec", "ParallelDims", "compare_plans"]
