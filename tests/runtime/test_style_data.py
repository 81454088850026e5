"""Styles are data: dict round trip, equality, hashing, readable repr, no mutation on apply."""
import json

import pytest
from torch.distributed.device_mesh import init_device_mesh

from autoplan.models import build_llama
from autoplan.models.llama_plans import EXPERT_PLANS
from hyper_parallel import (
    ColwiseParallel,
    NoParallel,
    Partial,
    PrepareLatentInput,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    parallelize_module,
    style_from_dict,
)
from hyper_parallel.core.style_registry import plan_from_dict, plan_to_dict
from hyper_parallel.local import fake_world

STYLES = [
    ColwiseParallel(),
    ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False),
    RowwiseParallel(output_layouts=Shard(1)),
    RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    SequenceParallel(),
    SequenceParallel(sequence_dim=0, use_local_output=True),
    NoParallel(input_layouts=Shard(1), output_layouts=Partial()),
    PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
    PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                       desired_input_kwarg_layouts={"hidden_states": Replicate()}, use_local_output=True),
    PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                             output_layouts=Partial("avg"), desired_output_layouts=Replicate()),
    PrepareLatentInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True,
                       broadcast_linear="kv_a_proj_with_mqa", broadcast_columns=["kv_lora_rank", None]),
]


@pytest.mark.parametrize("style", STYLES, ids=repr)
def test_round_trip_through_json(style):
    data = json.loads(json.dumps(style.to_dict()))
    back = style_from_dict(data)
    assert back == style and hash(back) == hash(style) and repr(back) == repr(style)
    assert type(back) is type(style)


def test_equality_and_defaults():
    assert ColwiseParallel() == ColwiseParallel(output_layouts=Shard(-1))
    assert ColwiseParallel() != ColwiseParallel(use_local_output=False)
    assert ColwiseParallel() != RowwiseParallel()
    assert ColwiseParallel().to_dict() == {"style": "ColwiseParallel", "args": {}}
    assert repr(RowwiseParallel(output_layouts=Shard(1))) == "RowwiseParallel(output_layouts=Shard(dim=1))"
    assert len({ColwiseParallel(), ColwiseParallel(), SequenceParallel()}) == 2


def test_whole_plan_round_trip():
    for name, make in EXPERT_PLANS.items():
        plan = make()
        assert plan_from_dict(json.loads(json.dumps(plan_to_dict(plan)))) == plan, name


def test_applying_never_changes_the_style():
    plan = EXPERT_PLANS["torchtitan"]()
    before = {k: json.dumps(v.to_dict(), sort_keys=True) for k, v in plan.items()}
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        parallelize_module(build_llama(device="meta", dim=32, n_heads=4, n_kv_heads=2), mesh, plan)
        parallelize_module(build_llama(device="meta", dim=32, n_heads=4, n_kv_heads=2), mesh, plan)
    assert {k: json.dumps(v.to_dict(), sort_keys=True) for k, v in plan.items()} == before
