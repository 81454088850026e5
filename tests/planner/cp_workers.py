"""Rank functions for tests/planner/test_context_plans.py: a plan with context parallelism,
applied with ``plan.apply``, trains one step equal to one device (the e2e_workers comparison), with
the attention variant each case names."""
from __future__ import annotations

from autoplan.plan import Plan
from tests.planner import e2e_workers


def with_variant(plan_json: str, variant: str) -> str:
    """The same plan running the other attention variant (numerics only: its predicted rows are
    those of the planner's choice)."""
    plan = Plan.from_json(plan_json)
    plan = plan.replace(parallel=dict(plan.parallel, cp=dict(plan.parallel["cp"], variant=variant)))
    return plan.to_json()


def run_cases(cases: list[tuple[str, str, str, str]]) -> dict:
    """{label: e2e_workers.run_case result} for (label, plan JSON, model name, variant) cases."""
    return {f"{label}/{variant}": e2e_workers.run_case(with_variant(plan_json, variant), model_name)
            for label, plan_json, model_name, variant in cases}
