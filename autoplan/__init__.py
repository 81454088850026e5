"""autoplan: automatic parallelization plans for PyTorch training.

    plan = autoplan(model, mesh, batch=(global_batch, seq_len))
    plan.to_json("plan.json")
    runner = plan.apply(model, device_mesh)
"""
from autoplan.api import autoplan
from autoplan.cluster import plan_cluster
from autoplan.plan import Plan
from autoplan.search import MeshSpec
from autoplan.review.compare import compare_plans

__all__ = ["autoplan", "plan_cluster", "Plan", "MeshSpec", "compare_plans"]
