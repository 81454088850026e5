"""Bad input raises a typed error naming the culprit, never hangs, and leaves the model as it was."""
import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoplan.models import build_llama
from autoplan.models.llama_plans import torchtitan_plan
from hyper_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
    parallelize_module,
    style_from_dict,
)
from hyper_parallel.errors import (
    DistributedRunError,
    DivisibilityError,
    HyperParallelError,
    LayoutError,
    MeshError,
    PlanPatternError,
    StyleSpecError,
    UnsupportedModuleError,
)
from hyper_parallel.local import fake_world
from tests.runtime import error_workers

CFG = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, ffn_hidden=128)


@pytest.fixture(scope="module")
def world4():
    with fake_world(4):
        yield {"tp": init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
               "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}


def snapshot(model: nn.Module):
    return ({n: (id(p), type(p)) for n, p in model.named_parameters()},
            sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()))


def assert_untouched(model, before):
    after = snapshot(model)
    assert after == before, "the model was modified by a failed parallelize_module"
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_mesh_of_wrong_rank_names_the_dims(world4):
    model = build_llama(**CFG)
    before = snapshot(model)
    with pytest.raises(MeshError, match=r"2-D mesh .*\('dp', 'tp'\).*mesh\['tp'\]"):
        parallelize_module(model, world4["2d"], torchtitan_plan())
    with pytest.raises(MeshError, match="mesh_dim='pp' is not one of"):
        parallelize_module(model, world4["2d"], torchtitan_plan(), mesh_dim="pp")
    assert_untouched(model, before)


def test_named_sub_mesh_of_2d_mesh_is_accepted(world4):
    model = build_llama(device="meta", **CFG)
    parallelize_module(model, world4["2d"], {"layers.*.attention.wq": ColwiseParallel()}, mesh_dim="tp")
    w = model.layers["0"].attention.wq.weight
    assert isinstance(w, DTensor) and w.device_mesh.mesh_dim_names == ("tp",)


def test_pattern_matching_nothing_names_pattern_and_suggests(world4):
    model = build_llama(**CFG)
    before = snapshot(model)
    plan = dict(torchtitan_plan(), **{"layers.*.attention.wqq": ColwiseParallel()})
    with pytest.raises(PlanPatternError, match=r"'layers\.\*\.attention\.wqq' matches no module"):
        parallelize_module(model, world4["tp"], plan, strict=True)
    with pytest.raises(PlanPatternError, match="did you mean"):
        parallelize_module(model, world4["tp"], {"tok_embedding": RowwiseParallel()}, strict=True)
    assert_untouched(model, before)


def test_equally_specific_patterns_on_one_module_are_an_error(world4):
    model = build_llama(**CFG)
    with pytest.raises(PlanPatternError, match="layers.0.attention.wq.*matched by both"):
        parallelize_module(model, world4["tp"], {"layers.*.attention.wq": ColwiseParallel(),
                                                 "layers.0.*.wq": RowwiseParallel()})


def test_most_specific_pattern_wins(world4):
    model = build_llama(device="meta", **CFG)
    parallelize_module(model, world4["tp"], {"layers.*.attention.wq": ColwiseParallel(),
                                             "layers.1.attention.wq": RowwiseParallel()})
    assert model.layers["0"].attention.wq.weight.placements == (Shard(0),)
    assert model.layers["1"].attention.wq.weight.placements == (Shard(1),)


def test_style_on_unsupported_module_type(world4):
    model = build_llama(**CFG)
    before = snapshot(model)
    with pytest.raises(UnsupportedModuleError, match=r"ColwiseParallel on layers\.0\.attention_norm.*RMSNorm"):
        parallelize_module(model, world4["tp"], dict(torchtitan_plan(), **{"layers.0.attention_norm": ColwiseParallel()}))
    assert_untouched(model, before)


def test_input_count_not_matching_layouts_caught_before_applying(world4):
    model = build_llama(**CFG)
    before = snapshot(model)
    bad = PrepareModuleInput(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))
    with pytest.raises(LayoutError, match=r"layers\.0\.attention.*3 entries.*2 positional"):
        parallelize_module(model, world4["tp"], dict(torchtitan_plan(), **{"layers.*.attention": bad}))
    assert_untouched(model, before)


def test_dimension_that_does_not_divide(world4):
    """Packed projections must split evenly (a strided uneven shard would mix them); a plain
    Linear of 30 outputs over 4 ranks is sharded unevenly, as torch's ColwiseParallel does."""
    model = nn.Sequential(nn.Linear(16, 30))
    before = snapshot(model)
    with pytest.raises(DivisibilityError, match=r"ColwiseParallel on 0: out_features per packed projection = 15 .* "
                                                r"mesh size 4"):
        parallelize_module(model, world4["tp"], {"0": ColwiseParallel(packed=2)})
    assert_untouched(model, before)
    parallelize_module(model, world4["tp"], {"0": ColwiseParallel()})
    assert tuple(model[0].weight.shape) == (30, 16) and tuple(model[0].weight.to_local().shape) == (8, 16)


def test_failure_while_applying_rolls_everything_back(world4):
    """Tied embedding/head with layouts that disagree is only found while applying (phase 2)."""
    model = build_llama(tie_embeddings=True, **CFG)
    before = snapshot(model)
    plan = dict(torchtitan_plan(), output=RowwiseParallel(input_layouts=Shard(1)))  # Shard(1) vs Shard(0)
    with pytest.raises(StyleSpecError, match="tied parameters need one layout"):
        parallelize_module(model, world4["tp"], plan)
    assert_untouched(model, before)
    assert model.output.weight is model.tok_embeddings.weight


def test_bad_style_data_is_rejected_without_eval():
    with pytest.raises(StyleSpecError, match="unknown style 'EvilParallel'"):
        style_from_dict({"style": "EvilParallel", "args": {}})
    with pytest.raises(StyleSpecError, match=r"ColwiseParallel.output_layouts: '__import__\(\"os\"\)'"):
        style_from_dict({"style": "ColwiseParallel", "args": {"output_layouts": '__import__("os")'}})
    with pytest.raises(StyleSpecError, match=r"unknown argument\(s\) \['gather'\]"):
        style_from_dict({"style": "RowwiseParallel", "args": {"gather": True}})
    with pytest.raises(LayoutError, match="input_layouts has 2 entries but desired_input_layouts has 1"):
        PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),))
    assert issubclass(StyleSpecError, HyperParallelError) and issubclass(StyleSpecError, ValueError)


def test_runtime_errors_on_real_ranks_do_not_hang(pool2):
    """A laid-out input that is not passed, and a sequence that does not divide, met in forward."""
    results = pool2.run(error_workers.runtime_errors)
    for rank, res in enumerate(results):
        assert res["count"].startswith("LayoutError") and "input 1 (rope)" in res["count"], (rank, res)
        assert res["divide"].startswith("DivisibilityError") and "= 9 is not divisible" in res["divide"], (rank, res)
    # the pool (and its process group) is still healthy afterwards
    assert pool2.run(error_workers.ping) == [0, 1]
