"""Plans as data: the Plan type, its JSON schema, and applying it with hyper_parallel."""
from autoplan.plan.plan import Plan
from autoplan.plan.schema import SCHEMA_VERSION

__all__ = ["Plan", "SCHEMA_VERSION"]
