"""Vision-language models from transformers: image inputs derived from the model, images through
the runners, and the two silent outcomes once seen (a tower planned but never run; a language
model left out of the plan) turned into trained-right or said-so."""
from __future__ import annotations

import pytest
import torch

from autoplan import MeshSpec, autoplan
from autoplan.capture import capture
from autoplan.capture.image_inputs import ImageBatch, derive, image_inputs
from autoplan.errors import CaptureError, InfeasiblePlanError
from autoplan.plan.forward import forward_tokens, output_logits
from autoplan.verify.numerics import check_numerics
from autoplan.verify.shrink import ModelRecipe
from tests.capture.vl_families import build



def mllama():
    return build("mllama")


def mllama_images(tokens):
    b = tokens.shape[0]
    return dict(pixel_values=torch.zeros(b, 1, 1, 3, 28, 28, device=tokens.device),
                aspect_ratio_ids=torch.ones(b, 1, dtype=torch.long, device=tokens.device),
                aspect_ratio_mask=torch.ones(b, 1, 1, dtype=torch.long, device=tokens.device),
                cross_attention_mask=torch.ones(b, tokens.shape[1], 1, 1, dtype=torch.long, device=tokens.device))


def florence2(with_images: bool = True):
    """A tiny Florence-2 (DaViT tower, BART encoder-decoder); its config has no image size, so
    the test gives the images through the model's hook: 17 image tokens for a 32x32 image."""
    torch.manual_seed(0)
    model = build("florence2")
    if with_images:
        model.extra_inputs = ImageBatch(100, 17, (3, 32, 32), "pixels", torch.float32)
    return model


@pytest.mark.parametrize("family, per_image", [("llava", 4), ("paligemma", 4), ("internvl", 1), ("mistral3", 4)])
def test_image_inputs_are_derived_and_run_the_model(family, per_image):
    """The image token count is measured from the model's own tower (the forward checks it), the
    same on meta (fake tensors: Pixtral reads its image sizes) as on CPU, and every row's image
    depends only on that row's tokens."""
    torch.manual_seed(0)
    model = build(family)
    batch = derive(model)
    assert batch.per_image == per_image and batch.token_id == 200
    with torch.device("meta"):
        assert derive(build(family)) == batch
    tokens = torch.randint(3, 199, (3, per_image + 6))
    out = output_logits(forward_tokens(model, tokens))   # raises if image tokens and features disagree
    assert out.shape == (3, per_image + 6, 256)
    whole, rows = image_inputs(model)(tokens), image_inputs(model)(tokens[1:])
    assert torch.equal(whole["pixel_values"][1:], rows["pixel_values"])
    assert (whole["input_ids"][:, :per_image] == 200).all()
    assert torch.equal(whole["input_ids"][:, per_image:], tokens[:, per_image:])
    model.to(torch.bfloat16)   # a model cast after its first step gets images of its new dtype
    assert image_inputs(model)(tokens)["pixel_values"].dtype == torch.bfloat16


@pytest.mark.parametrize("family, per_image", [("qwen2_5_vl", 4), ("llava_next", 10)])
def test_grid_and_tiled_image_inputs_run_the_model_as_its_processor_would(family, per_image):
    """Qwen2.5-VL (patches with a grid, windowed tower, M-RoPE) and LLaVA-NeXT (any-resolution
    tiles, image sizes) from the config alone: the model runs (it checks tokens against
    features), our M-RoPE positions are the model's own, a row's inputs depend on that row only,
    and a model on meta derives the same."""
    torch.manual_seed(0)
    model = build(family, 1, 2)
    batch = derive(model)
    assert batch.per_image == per_image
    with torch.device("meta"):
        assert derive(build(family, 1, 2)) == batch
    tokens = torch.randint(3, 199, (3, per_image + 6))
    out = output_logits(forward_tokens(model, tokens))
    whole, rows = image_inputs(model)(tokens), image_inputs(model)(tokens[1:])
    assert torch.equal(whole["pixel_values"][-rows["pixel_values"].shape[0]:], rows["pixel_values"])
    if family == "qwen2_5_vl":   # the model's own positions, from the token types a processor gives
        kw = {k: v for k, v in whole.items() if k in ("input_ids", "pixel_values", "image_grid_thw")}
        own = model(**kw, mm_token_type_ids=(kw["input_ids"] == 200).int()).logits
        torch.testing.assert_close(own, out, rtol=0, atol=0)
        assert whole["image_grid_thw"].tolist() == [[1, 4, 4]] * 3


def test_families_whose_images_are_not_one_tensor_are_refused_by_name():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="Mllama.*cross-attention"):
        forward_tokens(build("mllama"), torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(CaptureError, match="Florence2.*no image_size"):
        derive(build("florence2"))
    with pytest.raises(CaptureError, match="cannot hold one image of 4 image tokens"):
        derive(build("llava"))(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("family", ["idefics3", "qwen3_vl"])
def test_sizes_decided_by_input_values_are_measured_on_meta(family):
    """Idefics 3's tower drops images by their content, Qwen3-VL's decoder indexes its hidden
    states by a mask of image tokens: neither size exists on meta. Derive measures the image's
    tokens on one real image, capture exports on fake weights with inputs that hold values
    (export-values), so the tower and the decoder are traced, not left to the hooks."""
    with torch.device("meta"):
        model = build(family, 1, 2)
    per_image = derive(model).per_image
    assert isinstance(per_image, int) and per_image > 0
    graph = capture(model, batch=(2, per_image + 16))
    assert graph.method == "export-values", graph.warnings
    tower = [m for m in graph.modules if m.startswith(("model.vision_model.", "model.visual."))]
    assert tower and any(graph.nodes_in(m) for m in tower)
    assert any(graph.nodes_in(m) for m in graph.modules if m.startswith("model.text_model.layers")
               or m.startswith("model.language_model.layers"))


def test_a_decoder_indexing_by_its_image_tokens_is_sharded():
    """Qwen3-VL's DeepStack adds tower features at a boolean mask of image tokens: the soundness
    probe on fake tensors could not size it and rejected every sharded style (nothing sharded).
    It now runs once more with the tokens' values (probe.py, capture.fake.values_on)."""
    with torch.device("meta"):
        model = build("qwen3_vl", 32, 4)
    plan = autoplan(model, MeshSpec((4,), ("tp",)), batch=(2, 256))
    sharded = {d["unit"] for d in plan.decisions if d["strategy"] != "replicate"}
    assert {"model.language_model.layers/attention", "model.visual.blocks/mlp"} <= sharded, plan.notes


def test_mllama_language_model_is_planned_and_left_out_parts_are_said():
    """Mllama's text layers (self-attention around a cross-attention layer) form block groups, so
    the language model is in the plan; what no unit plans is a note, and a refusal when every unit
    must be sharded."""
    torch.manual_seed(0)
    model = mllama()
    model.extra_inputs = mllama_images
    graph = capture(model, batch=(2, 16))
    groups = {g.id: g.count for g in graph.blocks}
    assert groups["model.language_model.layers#0"] == 2 and groups["model.language_model.layers#1"] == 1
    plan = autoplan(model, 4, batch=(2, 16))
    assert any(d["unit"].startswith("model.language_model.layers") for d in plan.decisions)
    assert any(n.startswith("model.vision_model.global_transformer: kept replicated") for n in plan.notes)
    with pytest.raises(InfeasiblePlanError, match="model.vision_model.global_transformer: .* no unit plans"):
        autoplan(model, 4, batch=(2, 16), allow_replicated_units=False)


def test_florence2_images_reach_the_tower_in_a_step():
    """Florence-2's encoder-decoder forward used to drop the images: a plan sharded a tower that
    never ran. Every runner goes through forward_tokens, which now passes them."""
    model = florence2()
    tokens = torch.randint(3, 99, (2, 40))
    output_logits(forward_tokens(model, tokens)).float().pow(2).mean().backward()
    tower = [p.grad for n, p in model.named_parameters() if n.startswith("model.vision_tower.")]
    assert tower and all(g is not None for g in tower)


def test_llava_tensor_parallel_plan_shards_tower_and_decoder_and_trains_equal(pool4):
    """LLaVA planned at tp=4 from its config alone (no hook: the image inputs are derived), at 32x
    the small widths with 224-pixel images on meta: both the CLIP tower's and the decoder's
    attention and MLP are sharded, and the plan trains equal to one device on the small copy."""
    with torch.device("meta"):
        wide = build("llava", 32, 8)
    plan = autoplan(wide, MeshSpec((4,), ("tp",)), batch=(2, 512))
    sharded = {d["unit"] for d in plan.decisions if d["strategy"] != "replicate"}
    assert {"model.vision_tower.encoder.layers/attention", "model.vision_tower.encoder.layers/mlp",
            "model.language_model.layers/attention", "model.language_model.layers/mlp"} <= sharded
    recipe = ModelRecipe(factory="tests.capture.vl_families:build", kwargs={"family": "llava", "image": 2}, seed=3)
    result = check_numerics(plan, recipe, pool=pool4, seq=40)
    assert result.passed, result.summary()


def test_qwen2_5_vl_tensor_parallel_plan_shards_tower_and_decoder_and_trains_equal(pool4):
    """Qwen2.5-VL planned on dp=2 x tp=2 from its config alone: capture on meta resolves the
    tower's grid-sized splits from the real grid (the size inputs stay real), the plan shards the
    windowed tower's MLP and the decoder's attention and MLP, and trains equal to one device --
    each dp rank building its rows' images, grids and positions, under FSDP's wrapper class, with
    random text that may hold the image token id."""
    with torch.device("meta"):
        wide = build("qwen2_5_vl", 32, 8)
    plan = autoplan(wide, MeshSpec((2, 2), ("dp", "tp")), batch=(4, 512))
    sharded = {d["unit"] for d in plan.decisions if d["strategy"] != "replicate"}
    assert {"model.visual.blocks/mlp", "model.language_model.layers/attention",
            "model.language_model.layers/mlp"} <= sharded
    recipe = ModelRecipe(factory="tests.capture.vl_families:build", kwargs={"family": "qwen2_5_vl", "image": 2}, seed=3)
    result = check_numerics(plan, recipe, pool=pool4, seq=40)
    assert result.passed, result.summary()
