"""Plans as data: the Plan type, its JSON schema, and applying it with hyper_parallel."""
from autoplan.plan.plan import SCHEMA_VERSION, Plan

__all__ = ["Plan", "SCHEMA_VERSION"]
