"""Vision-language models from transformers: image inputs derived from the model, images through
the runners, and the two silent outcomes of issue 31 (a tower planned but never run; a language
model left out of the plan) turned into trained-right or said-so."""
from __future__ import annotations

import pytest
import torch
import transformers

from autoplan import autoplan
from autoplan.capture import capture
from autoplan.capture.image_inputs import ImageBatch, derive, image_inputs
from autoplan.errors import CaptureError, InfeasiblePlanError
from autoplan.plan.forward import forward_tokens, output_logits
from autoplan.verify.numerics import check_numerics
from autoplan.verify.shrink import ModelRecipe

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28,
              patch_size=14)


def llava():
    return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
        text_config=dict(model_type="llama", **TEXT), image_token_index=200, vision_feature_layer=-1,
        vision_config=dict(model_type="clip_vision_model", projection_dim=32, **VISION)))


def paligemma():
    return transformers.PaliGemmaForConditionalGeneration(transformers.PaliGemmaConfig(
        text_config=dict(model_type="gemma", **TEXT), vision_config=dict(model_type="siglip_vision_model", **VISION),
        image_token_index=200, projection_dim=64))


def internvl():
    return transformers.InternVLForConditionalGeneration(transformers.InternVLConfig(
        text_config=dict(model_type="qwen2", **TEXT), image_token_id=200, downsample_ratio=0.5,
        vision_config=dict(model_type="internvl_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=[28, 28], patch_size=[14, 14])))


def mistral3():
    return transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=dict(model_type="mistral", **TEXT), image_token_index=200, spatial_merge_size=2,
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=56, patch_size=14, head_dim=8)))


def qwen2_vl():
    return transformers.Qwen2VLForConditionalGeneration(transformers.Qwen2VLConfig(
        text_config=dict(model_type="qwen2_vl_text", rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                         **TEXT),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, in_channels=3, patch_size=14),
        image_token_id=200))


def mllama():
    return transformers.MllamaForConditionalGeneration(transformers.MllamaConfig(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=4, image_size=28, patch_size=14, vision_output_dim=128,
                           intermediate_layers_indices=[0], max_num_tiles=1, supported_aspect_ratios=[[1, 1]]),
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=256, cross_attention_layers=[1], pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)))


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
    model = transformers.Florence2ForConditionalGeneration(transformers.Florence2Config(
        vision_config=dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                           patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[2, 4], num_groups=[2, 4],
                           window_size=2, projection_dim=32, drop_path_rate=0.0, max_position_embeddings=16),
        text_config=dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                         pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2),
        image_token_id=100))
    if with_images:
        model.extra_inputs = ImageBatch(100, 17, (3, 32, 32), "pixels", torch.float32)
    return model


@pytest.mark.parametrize("build, per_image", [(llava, 4), (paligemma, 4), (internvl, 1)])
def test_image_inputs_are_derived_and_run_the_model(build, per_image):
    """The image token count is measured from the model's own tower (the forward checks it), the
    same on meta as on CPU, and every row's image depends only on that row's tokens."""
    torch.manual_seed(0)
    model = build()
    batch = derive(model)
    assert batch.per_image == per_image and batch.token_id == 200
    with torch.device("meta"):
        assert derive(build()) == batch
    tokens = torch.randint(3, 199, (3, per_image + 6))
    out = output_logits(forward_tokens(model, tokens))   # raises if image tokens and features disagree
    assert out.shape == (3, per_image + 6, 256)
    whole, rows = image_inputs(model)(tokens), image_inputs(model)(tokens[1:])
    assert torch.equal(whole["pixel_values"][1:], rows["pixel_values"])
    assert (whole["input_ids"][:, :per_image] == 200).all()
    assert torch.equal(whole["input_ids"][:, per_image:], tokens[:, per_image:])


def test_families_whose_images_are_not_one_tensor_are_refused_by_name():
    torch.manual_seed(0)
    with pytest.raises(CaptureError, match="Qwen2VLForConditionalGeneration.*image_grid_thw.*extra_inputs"):
        derive(qwen2_vl())
    with torch.device("meta"):
        model = mistral3()
    with pytest.raises(CaptureError, match="Mistral3ForConditionalGeneration.get_image_features failed"):
        derive(model)
    with pytest.raises(CaptureError, match="cannot hold one image of 4 image tokens"):
        derive(llava())(torch.zeros(1, 4, dtype=torch.long))


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


def test_florence2_plan_trains_equal_to_one_device(pool2):
    """A data-parallel plan of Florence-2 on 2 gloo ranks: loss and every gradient (the tower's
    included) equal one device; images come from the hook on every rank."""
    plan = autoplan(florence2(), 2, batch=(2, 40))
    recipe = ModelRecipe(factory="tests.capture.test_image_inputs:florence2", seed=5)
    result = check_numerics(plan, recipe, pool=pool2, global_batch=2, seq=40)
    assert result.passed, result.summary()
    assert result.n_grads == sum(1 for _ in florence2().parameters())
