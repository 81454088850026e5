"""Test-only helpers: side-by-side training against one device (``compare.compare_steps``) and
per-module collective counts from CommDebugMode (``comm_counts.count_collectives``).

What library code needs to run locally (rank pools, the fake process group, the collective
recorder, gathering DTensors) lives in :mod:`hyper_parallel.local`; nothing outside tests/
imports this package (tests/test_no_testing_imports.py).
"""
from hyper_parallel.testing.comm_counts import count_collectives
from hyper_parallel.testing.compare import StepComparison, compare_steps

__all__ = ["StepComparison", "compare_steps", "count_collectives"]
