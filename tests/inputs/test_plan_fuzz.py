"""Plan-file fuzzing, a fixed-seed slice: 400 random mutations of three valid plans (mesh plan
with SP styles, pipelined cluster plan, torchtitan styles). Each mutant is refused with
PlanSchemaError or loads to exactly its data and survives every later use; 0 escapes.
The 10,000-mutation run: ``python benchmarks/plan_fuzz.py`` (results in
benchmarks/results/plan_fuzz.md)."""
from __future__ import annotations

from tests.inputs.plan_mutations import base_plans, fuzz


def test_plan_fuzz_slice():
    res = fuzz(base_plans(), 400, seed=19)
    assert res.mutations == 400
    assert res.escapes == []
    # the mutator is not vacuous: both outcomes happen, for every kind of edit
    assert res.refused > 80 and res.loaded > 80, (res.refused, res.loaded)
    assert len(res.by_op) >= 10
