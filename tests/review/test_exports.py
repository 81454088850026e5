"""Exports: torch-native styles and the Python snippet reproduce hyper_parallel's numerics;
HF ``tp_plan`` strings say exactly which entries they cannot express."""
from __future__ import annotations

import pytest
import torch

from autoplan import MeshSpec, autoplan
from autoplan.models import build_llama
from autoplan.models.llama_plans import megatron_plan, torchtitan_plan
from autoplan.review import to_hf_tp_plan, to_python, to_torch
from autoplan.importers import import_plan, styles_from_hf
from tests.review import export_workers

CPU2 = MeshSpec((2,), ("tp",), "cpu")


@pytest.fixture(scope="module")
def small_plans():
    model = build_llama(device="meta", **export_workers.MODEL)
    auto = autoplan(model, CPU2, batch=(2, 16), dtype=torch.float32, allow_replicated_units=False)
    titan = import_plan(model, CPU2, torchtitan_plan(), name="torchtitan", batch=(2, 16), dtype=torch.float32)
    return {"auto": auto, "torchtitan": titan}


def test_torch_dict_and_snippet_match_hyper_parallel_on_two_ranks(small_plans, pool2):
    """The torch-native dict applied with torch's parallelize_module (and the snippet run as
    code) trains like hyper_parallel and like one device: losses, logits and every gradient."""
    for name, plan in small_plans.items():
        reports = pool2.run(export_workers.apply_three_ways, plan.styles, to_python(plan))
        for rank, r in enumerate(reports):
            for way in ("hyper_parallel", "torch", "snippet"):
                where = f"{name} rank {rank} via {way}"
                assert r[way]["loss"] == pytest.approx(r["loss_ref"], rel=1e-5), where
                assert r[way]["logits_ok"], where
                assert r[way]["grad_bad"] == [], f"{where}: {r[way]['grad_bad']}"
                assert r[way]["dtensor_params"] > 0, where
            assert r["torch"]["loss"] == pytest.approx(r["hyper_parallel"]["loss"], rel=1e-6)


def test_to_torch_gives_torch_styles(small_plans):
    import torch.distributed.tensor.parallel as tp

    styles = to_torch(small_plans["torchtitan"], build_llama(device="meta", **export_workers.MODEL))
    assert set(styles) == set(small_plans["torchtitan"].styles)
    assert isinstance(styles["layers.*.attention.wq"], tp.ColwiseParallel)
    assert isinstance(styles["norm"], tp.SequenceParallel)
    assert isinstance(styles["layers.*.attention"], tp.PrepareModuleInput)


def test_snippet_is_readable_python(small_plans):
    text = to_python(small_plans["torchtitan"])
    compile(text, "<snippet>", "exec")
    assert "'layers.*.attention.wo': RowwiseParallel(output_layouts=Shard(1))," in text
    assert "parallelize_module(model, mesh, tp_plan, mesh_dim='tp')" in text
    assert "loss_parallel" in text


def test_snippet_wraps_fsdp_when_the_plan_does():
    model = build_llama(device="meta", **export_workers.MODEL)
    plan = autoplan(model, MeshSpec((4, 2), ("dp", "tp"), "cpu"), batch=(8, 16), dtype=torch.float32)
    text = to_python(plan)
    assert "fully_shard(block, mesh=mesh['dp'])" in text and "fully_shard(model, mesh=mesh['dp'])" in text


def test_hf_export_of_megatron_plan_is_complete_and_round_trips():
    model = build_llama(device="meta", **export_workers.MODEL)
    plan = import_plan(model, CPU2, megatron_plan(), batch=(2, 16), dtype=torch.float32)
    hf = to_hf_tp_plan(plan, model)
    assert hf.complete, hf.not_expressible
    assert hf.tp_plan["layers.*.attention.wq"] == "colwise" and hf.tp_plan["layers.*.feed_forward.w2"] == "rowwise"
    assert hf.tp_plan["output"] == "colwise_gather_output" and hf.tp_plan["tok_embeddings"] == "embedding_rowwise"
    assert to_hf_tp_plan(plan, model, version="v4").tp_plan["output"] == "colwise_rep"
    assert set(hf.omitted) == {"layers.*.attention", "layers.*.feed_forward"}  # no-op annotations
    back = styles_from_hf(hf.tp_plan, prefix="", keep_prefixed=())
    kept = {k: v for k, v in plan.styles.items() if k not in hf.omitted}
    # equal as torch styles (the planner writes some defaults out, e.g. a Replicate() input)
    assert {k: repr(v) for k, v in to_torch(back, model).items()} == \
        {k: repr(v) for k, v in to_torch(kept, model).items()}


def test_hf_export_names_what_it_cannot_express(small_plans):
    hf = to_hf_tp_plan(small_plans["torchtitan"])
    assert not hf.complete
    assert "reduce-scatter" in hf.not_expressible["layers.*.attention.wo"]
    assert "loss parallel" in hf.not_expressible["output"]
    assert "layout change" in hf.not_expressible["layers.*.attention"]
    assert hf.tp_plan["norm"] == "sequence_parallel" and hf.tp_plan["layers.*.attention.wq"] == "colwise"
    assert not set(hf.tp_plan) & set(hf.not_expressible)


def test_hf_base_model_keys_drop_the_prefix():
    from autoplan.presets import build_preset

    model = build_preset("llama3-8b", num_layers=2)
    plan = autoplan(model, MeshSpec((8, 8), ("dp", "tp"), "h100_sxm"), batch=(64, 4096), sequence_parallel=False)
    hf = to_hf_tp_plan(plan, model)
    assert hf.base_model_tp_plan["layers.*.self_attn.q_proj"] == "colwise"
    assert hf.tp_plan["model.layers.*.self_attn.q_proj"] == "colwise"
