"""The parallelism registry: one entry per parallelism owns its plan section, its checks, its place
in the application order and its traffic; plans, schema, runners and verify read the registry."""
from __future__ import annotations

import json

import pytest
import torch

from autoplan import MeshSpec, autoplan
from autoplan.errors import PlanSchemaError
from autoplan.parallelisms import PARALLELISMS, ApplyTarget, default_sections, parallel_schema, parallelism
from autoplan.parallelisms.registry import traffic_owners
from autoplan.plan import Plan
from autoplan.plan.schema import plan_schema
from hyper_parallel import ParallelDims
from tests.inputs.helpers import tiny_llama


@pytest.fixture(scope="module")
def plan():
    return autoplan(tiny_llama(), MeshSpec((2, 2), ("dp", "tp"), "h100_sxm"), batch=(4, 16),
                    allow_replicated_units=False)


def test_order_is_torchtitans_with_the_pipeline_around():
    names = [p.name for p in PARALLELISMS]
    assert names.index("pp") < names.index("tp") < names.index("ac") < names.index("dp")
    assert len(set(names)) == len(names)
    with pytest.raises(KeyError, match="registered"):
        parallelism("zz")


def test_every_section_comes_from_its_entry():
    schema = plan_schema()["properties"]["parallel"]
    assert schema == parallel_schema()
    assert set(schema["properties"]) == {p.name for p in PARALLELISMS} == set(default_sections())
    # a section added after schema 3 is optional: files written before it load with it null
    assert set(schema["required"]) == {p.name for p in PARALLELISMS if not p.optional}
    assert {p.name for p in PARALLELISMS if p.optional} == {"precision"}


def test_roles_are_mesh_dimensions_and_each_is_owned_once():
    seen = {}
    for p in PARALLELISMS:
        for role in p.roles:
            ParallelDims((2,), (role,))          # a role is a name of the mesh vocabulary
            assert role not in seen, (role, p.name, seen.get(role))
            seen[role] = p.name


def test_plan_sections_and_properties_agree(plan):
    assert plan.parallel["tp"]["styles"] is plan.styles and plan.tp_dim == "tp" == plan.parallel["tp"]["dim"]
    assert plan.dp_dim == "dp" and plan.fsdp == plan.parallel["dp"]["fsdp"]
    assert plan.parallel["hsdp"] is None and plan.parallel["pp"] is None
    copy = plan.replace(styles={})
    assert copy.styles == {} and plan.styles, "replace copies"
    with pytest.raises(TypeError, match="unknown field"):
        plan.replace(stylez={})


def test_traffic_owners_name_each_rows_parallelism(plan):
    owners = traffic_owners(plan)
    assert owners == {"tp": "tp", "dp": "dp"}
    assert {owners[r["mesh_dim"]] for r in plan.predictions["collectives"]} == {"tp", "dp"}
    no_tp = plan.replace(styles={}, stream_layout="R", loss_parallel=False)
    assert traffic_owners(no_tp) == {"dp": "dp"}


def test_a_section_is_checked_by_its_entry(plan):
    data = plan.to_dict()
    data["parallel"]["ac"] = {"mode": "full", "modules": ["layers.*.attention"]}
    with pytest.raises(PlanSchemaError, match="parallel/ac/modules"):
        Plan.from_json(json.dumps(data))
    data = plan.to_dict()
    data["parallel"]["dp"]["dim"] = "tp"
    with pytest.raises(PlanSchemaError, match="parallel/dp/dim"):
        Plan.from_json(json.dumps(data))
    data = plan.to_dict()
    data["parallel"]["extra"] = None
    with pytest.raises(PlanSchemaError, match="Additional properties"):
        Plan.from_json(json.dumps(data))


def test_apply_walks_the_registry_in_order(plan, monkeypatch):
    """Both runners apply through the registry: record the calls the entries receive."""
    from autoplan.parallelisms import registry

    calls = []
    for p in PARALLELISMS:
        monkeypatch.setattr(type(p), "apply_to_model",
                            lambda self, plan, target, n=p.name: calls.append(("model", n)))
        monkeypatch.setattr(type(p), "apply_to_roots",
                            lambda self, plan, target, n=p.name: calls.append(("roots", n)))
    target = ApplyTarget(model=torch.nn.Linear(2, 2), mesh=None, roots=[])
    registry.apply_to_model(plan, target)
    registry.apply_to_roots(plan, target)
    order = [p.name for p in PARALLELISMS]
    assert calls == [("model", n) for n in order] + [("roots", n) for n in order]
