"""The parallelisms a plan decides, one registry entry each (see ``base`` for the contract and
``registry`` for the list)."""
from autoplan.parallelisms.base import ApplyTarget, Parallelism
from autoplan.parallelisms.registry import PARALLELISMS, default_sections, parallel_schema, parallelism

__all__ = ["ApplyTarget", "PARALLELISMS", "Parallelism", "default_sections", "parallel_schema", "parallelism"]
