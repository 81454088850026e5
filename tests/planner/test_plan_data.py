"""Plans are data: deterministic JSON, schema validation, typed errors for impossible requests."""
import json

import pytest

from autoplan import MeshSpec, Plan, autoplan
from autoplan.errors import InfeasiblePlanError, PlanSchemaError
from autoplan.models import build_llama
from tests.planner import models

MESH = MeshSpec((8, 8), ("dp", "tp"), "h100_sxm")


@pytest.fixture(scope="module")
def plan():
    return autoplan(models.repo_llama_8b(layers=2), MESH, batch=(64, 4096))


def test_identical_inputs_give_byte_identical_json(plan):
    again = autoplan(models.repo_llama_8b(layers=2), MESH, batch=(64, 4096))
    assert again.to_json() == plan.to_json()
    assert "timing" not in json.loads(plan.to_json()) and "timing" in json.loads(plan.to_json(timing=True))


def test_round_trip(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.to_json(path)
    back = Plan.from_json(path)
    assert back.to_json() == plan.to_json()
    assert back.tp_plan() == plan.tp_plan()


def test_plan_contents(plan):
    p = plan.predictions
    assert p["step_s"] == pytest.approx(p["compute_s"] + p["comm_s"])
    assert set(p["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "total"}
    kinds = {(c["kind"], c["mesh_dim"]) for c in p["collectives"]}
    assert ("all_gather", "tp") in kinds and ("reduce_scatter", "tp") in kinds and ("all_gather", "dp") in kinds
    assert plan.solver["status"] == "Optimal" and plan.solver["variables"] > 0
    assert {a["name"] for a in plan.alternatives} >= {"replicated", "megatron", "sequence_parallel"}
    assert list(plan.summary().columns)[:4] == ["unit", "block_prefix", "count", "strategy"]


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d.update(schema_version=99), "schema_version 99 is not supported"),
    (lambda d: d["parallel"]["tp"]["styles"].update({"x": {"style": "EvilParallel", "args": {}}}), "unknown style 'EvilParallel'"),
    (lambda d: d["parallel"]["tp"]["styles"].update({"x": {"style": "ColwiseParallel", "args": {"output_layouts": "os.system"}}}),
     "not a placement"),
    (lambda d: d["mesh"].update(shape="eight"), "plan field mesh/shape"),
    (lambda d: d.pop("predictions"), "'predictions' is a required property"),
])
def test_schema_rejects_bad_plans(plan, mutate, message):
    data = json.loads(plan.to_json())
    mutate(data)
    with pytest.raises(PlanSchemaError, match=message):
        Plan.from_dict(data)


def test_truncated_plan_is_rejected(plan):
    with pytest.raises(PlanSchemaError, match="corrupted or truncated"):
        Plan.from_json(plan.to_json()[:200])


def test_memory_limit_below_minimum_states_the_minimum():
    with pytest.raises(InfeasiblePlanError, match=r"memory_limit=0.06 GiB .* the minimum is (\d+\.\d+) GiB") as e:
        autoplan(models.repo_llama_8b(layers=2), MESH, batch=(64, 4096), memory_limit=2**26)
    minimum = float(str(e.value).split("the minimum is ")[1].split(" GiB")[0])
    plan = autoplan(models.repo_llama_8b(layers=2), MESH, batch=(64, 4096), memory_limit=(minimum + 0.01) * 2**30)
    assert plan.predictions["memory_bytes"]["total"] <= (minimum + 0.01) * 2**30


def test_tp_not_dividing_heads_splits_them_whole_or_names_the_divisibility():
    # 12 heads over tp=8: split whole and unevenly (1 or 2 heads a rank; tests/planner/test_uneven_heads.py)
    model = build_llama(device="meta", dim=768, n_layers=2, n_heads=12, n_kv_heads=12, vocab_size=32000,
                        ffn_hidden=3072, max_seq_len=1024)
    plan = autoplan(model, MESH, batch=(64, 1024), allow_replicated_units=False)
    assert {d["unit"]: d["strategy"] for d in plan.decisions}["layers/attention"] == "heads_uneven"
    # 4 heads over tp=8: a rank would hold no whole head
    model = build_llama(device="meta", dim=256, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=32000,
                        ffn_hidden=1024, max_seq_len=1024)
    with pytest.raises(InfeasiblePlanError, match=r"attention.*heads 4 / KV heads 4 not divisible by tp=8.*"
                                                  r"4 heads are fewer than tp=8"):
        autoplan(model, MESH, batch=(64, 1024), allow_replicated_units=False)


def test_missing_batch_is_a_typed_error():
    from autoplan.errors import MissingInputsError

    with pytest.raises(MissingInputsError):
        autoplan(build_llama(device="meta"), MESH)
