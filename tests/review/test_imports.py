"""Imports: the published torchtitan plan and an HF base_model_tp_plan become priced Plans."""
from __future__ import annotations

import pytest

from autoplan import MeshSpec, autoplan
from autoplan.models.llama_plans import torchtitan_plan
from autoplan.parallelisms.tensor import runner_styles
from autoplan.presets import build_preset
from autoplan.importers import import_hf_tp_plan, import_torchtitan, styles_from_expert, styles_from_hf
from autoplan.importers import PlanImportError, load_reference

MESH = MeshSpec((8, 8), ("dp", "tp"), "h100_sxm")
BATCH = (64, 8192)


@pytest.fixture(scope="module")
def titan_model():
    return build_preset("titan-llama3-70b", num_layers=2)


def test_torchtitan_reference_data_parses_to_the_repo_plan(titan_model):
    data = load_reference("torchtitan/llama3")["tp_plan"]
    for lp in (True, False):
        got = styles_from_expert(data, model=titan_model, loss_parallel=lp)
        # as the runners apply them: the repo plan says reduce_grads=True, torchtitan's leaves torch's default
        assert runner_styles(got) == runner_styles({k: v.to_dict() for k, v in torchtitan_plan(loss_parallel=lp).items()})
    # the published 4-entry PrepareModuleInput is cut to the repo Attention's (x, rope)
    assert got["layers.*.attention"]["args"]["input_layouts"] == ["Shard(1)", None]


def test_torchtitan_import_is_priced_like_any_plan(titan_model):
    plan = import_torchtitan(titan_model, MESH, batch=BATCH)
    same = autoplan(titan_model, MESH, batch=BATCH, styles=torchtitan_plan())
    assert plan.model["plan_name"] == "torchtitan" and plan.solver["status"] == "imported"
    assert plan.step_time == pytest.approx(same.step_time)
    assert plan.stream_layout == "S" and plan.loss_parallel
    assert {d["unit"]: d["strategy"] for d in plan.decisions} == {
        "embedding": "vocab_sharded", "final_norm": "sequence", "head": "loss_parallel",
        "layers/attention": "heads_sharded", "layers/mlp": "hidden_sharded", "layers/norms": "sequence"}
    assert plan.predictions["collectives"] and plan.predictions["memory_bytes"]["total"] > 0
    # the planner's own answer on this shape is the torchtitan plan
    assert autoplan(titan_model, MESH, batch=BATCH).diff(plan).empty


def test_hf_base_model_tp_plan_import():
    model = build_preset("llama3-70b", num_layers=2)
    plan = import_hf_tp_plan(model, MESH, batch=BATCH)
    assert plan.model["plan_name"] == "hf_tp_plan_v5"
    assert plan.styles["model.layers.*.self_attn.o_proj"] == {"style": "RowwiseParallel", "args": {}}
    assert plan.styles["lm_head"]["args"]["output_layouts"] == "Replicate()"
    strategies = {d["unit"]: d["strategy"] for d in plan.decisions}
    assert strategies["head"] == "vocab_sharded_gather" and strategies["model.layers/mlp"] == "hidden_sharded"
    assert plan.stream_layout == "R" and not plan.loss_parallel
    # HF's inference plan is slower to train with than the planner's (no SP, no loss parallel)
    assert autoplan(model, MESH, batch=BATCH).step_time < plan.step_time


def test_hf_strings_and_errors():
    styles = styles_from_hf({"layers.*.mlp.up_proj": "colwise", "layers.*.input_layernorm": "replicate",
                             "lm_head": {"v4.x": "colwise_rep", "v5": "colwise_gather_output"}})
    assert styles == {"model.layers.*.mlp.up_proj": {"style": "ColwiseParallel", "args": {}},
                      "lm_head": {"style": "ColwiseParallel", "args": {"output_layouts": "Replicate()"}}}
    with pytest.raises(PlanImportError, match="'grouped_gemm' for 'layers.*.mlp.experts'"):
        styles_from_hf({"layers.*.mlp.experts": "grouped_gemm"})
    with pytest.raises(PlanImportError, match="entry 'x'"):
        styles_from_expert({"x": {"style": "ColwiseParallel", "args": {"output_layouts": "os.system"}}})
    with pytest.raises(PlanImportError, match="not in"):
        load_reference("no/such/plan")
