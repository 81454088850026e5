"""Float8 training in the runtime: conversion, refusals, and plans in float8 equal to one device in
float8 for five steps (emulated on CPU). The whole family x layout x recipe matrix is
benchmarks/float8_matrix.py; here one case per data-parallel form."""
import logging

import pytest
import torch
import torch.nn as nn

from autoplan import MeshSpec, autoplan
from autoplan.plan import Plan
from autoplan.verify.float8_models import float8_recipe
from autoplan.verify.float8_steps import check_float8_steps, float8_casts_rank
from hyper_parallel.core.float8 import (
    Float8Error,
    Float8HardwareError,
    Float8ShapeError,
    convert_to_float8,
    float8_shape_problem,
    quiet_torchao_import,
    resolve_emulate,
)


class _Tiny(nn.Module):
    def __init__(self, width=32, odd=24):
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.odd = nn.Linear(2 * width, odd)
        self.norm = nn.LayerNorm(odd)


def test_conversion_keeps_parameters_and_names():
    model = _Tiny()
    weight = model.up.weight
    done = convert_to_float8(model, {"up": "tensorwise"})
    assert type(model.up).__name__ == "Float8Linear" and model.up.weight is weight
    assert done.modules == {"up": "tensorwise"} and done.emulate   # no float8 GEMM on this CPU
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in _Tiny().named_parameters()]
    out = model.up(torch.randn(4, 32))
    assert out.shape == (4, 64)


@pytest.mark.parametrize("modules, error, words", [
    ({"odd": "tensorwise"}, Float8ShapeError, "out_features 24"),
    ({"norm": "rowwise"}, Float8Error, "not a plain nn.Linear"),
    ({"up": "e4m3"}, Float8Error, "not a float8 recipe"),
    ({"nothing.*": "tensorwise"}, Float8Error, "matches no module"),
    ({"up": "mxfp8"}, Float8HardwareError, "Blackwell"),
])
def test_refusals_name_module_and_reason(modules, error, words):
    model = _Tiny()
    with pytest.raises(error, match=words):
        convert_to_float8(model, modules)
    assert type(model.up) is nn.Linear   # checked before any swap


def test_shape_problem_at_the_shard():
    assert float8_shape_problem(4096, 1024, "tensorwise") == ""
    assert "1024 / 128 = 8 per rank" in float8_shape_problem(1024, 4096, "rowwise", shards=(128, 1))
    with pytest.raises(Float8HardwareError, match="emulate=False"):
        resolve_emulate("tensorwise", "cpu", emulate=False)


def test_quiet_filter_drops_only_the_known_lines(caplog):
    quiet_torchao_import()
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("Failed to load /x/site-packages/torchao/_C_mxfp8.so: nope")
        logging.getLogger("torchao").warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
    caplog.clear()
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    with caplog.at_level(logging.WARNING):
        for op in ("max", "sum"):   # a max is exact in any order: its two-step warning says nothing
            redistribute.warning(f"While redistributing from (Partial({op}), Partial({op})) to (Replicate(), "
                                 f"Replicate()), 2 sequential all_reduce operations will be performed.")
    assert [r.getMessage()[:40] for r in caplog.records] == ["While redistributing from (Partial(sum),"]


def test_plans_without_precision_load():
    plan = Plan.from_json("benchmarks/results/planning_cold_plans/70b-512.json")
    assert plan.parallel["precision"] is None


def _float8_plan(family, shape, names, recipe, **opts):
    model = float8_recipe(family).build("meta")
    plan = autoplan(model, MeshSpec(shape, names, "h100_sxm"), batch=(4, 16), dtype=torch.float32,
                    allow_replicated_units=False, **opts)
    modules = {n: recipe for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"
               and not n.endswith(".gate")}
    plan = plan.replace(parallel={**plan.parallel, "precision": {
        "modules": modules, "fsdp_float8_all_gather": recipe == "tensorwise"}})
    return Plan.from_json(plan.to_json())


@pytest.mark.parametrize("family, shape, names, recipe, opts", [
    ("qwen3", (2, 2), ("dp", "tp"), "tensorwise", dict(sequence_parallel=False)),   # FSDP, float8 all-gather
    ("llama", (4,), ("tp",), "rowwise", dict(sequence_parallel=True)),
])
def test_float8_plan_equals_one_device_in_float8(family, shape, names, recipe, opts, pool4):
    plan = _float8_plan(family, shape, names, recipe, **opts)
    r = check_float8_steps(plan, float8_recipe(family), pool=pool4)
    assert r.error is None, r.error
    assert r.passed, (r.par, r.float8)
    assert r.max_rel_high > 1e-4, "float8 did not change the numbers"
    assert r.linears and r.linears == r.linears_one   # the same Linears in float8 on both sides
    if names == ("dp", "tp"):
        assert plan.fsdp["enabled"] and r.gathered > 0


def test_precision_by_name_on_a_plan():
    from autoplan.errors import InvalidArgumentError
    from autoplan.precision.request import with_precision
    from autoplan.train.config import TrainConfig
    from autoplan.train.errors import TrainConfigError

    model = float8_recipe("mixtral").build("meta")
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(4, 16), dtype=torch.float32,
                    allow_replicated_units=False)
    f8 = with_precision(plan, model, "fp8-rowwise")
    section = f8.parallel["precision"]
    assert set(section["modules"].values()) == {"rowwise"} and "model.layers.*.self_attn.q_proj" in section["modules"]
    assert "lm_head" in section["kept"] and any("experts run in high precision" in n for n in f8.notes)
    assert Plan.from_json(f8.to_json()).parallel["precision"] == section
    back = with_precision(f8, model, "bf16")
    assert back.parallel["precision"] is None and not any(n.startswith("precision: ") for n in back.notes)
    with pytest.raises(InvalidArgumentError, match="fp8-e4m3"):
        with_precision(plan, model, "fp8-e4m3")
    with pytest.raises(TrainConfigError, match="--precision"):
        TrainConfig(precision="fp16").check()


def test_every_cast_scale_equals_one_device_under_tp(pool4):
    """Qwen3 at tp=4 tensorwise, one step: the plan makes the casts one device makes, in order, each
    with one device's scale (a scale over a shard would differ); benchmarks/float8_casts.py is the
    table of all three families and both recipes."""
    plan = _float8_plan("qwen3", (4,), ("tp",), "tensorwise", sequence_parallel=True)
    ranks = pool4.run(float8_casts_rank, plan.to_json(), float8_recipe("qwen3"), 2, 16)
    for r in ranks:
        assert r["count"] == (84, 84) and all(c["comparable"] and c["scale_equal"] for c in r["casts"])
