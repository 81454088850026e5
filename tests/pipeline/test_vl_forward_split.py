"""transformers' VL models cut by the general stage split, on one process.

The tower is what the token-only forward never calls (stage 0's, or MPipe's ImageFeatures); the
chained stages with their images compute the model's function, and the guard that checks a split
sees it when they would not (a tower dropped, a stage without the step's token ids)."""
from __future__ import annotations

import pytest
import torch

from autoplan.capture.image_inputs import image_inputs
from autoplan.search.pipeline.support import pipeline_refusal
from autoplan.verify.shrink import recipe_for, shrink_hf_config
from hyper_parallel.core.pipeline_parallel import ImageFeatures, split_gap
from hyper_parallel.core.pipeline_parallel import forward_split as fs
from tests.capture.vl_families import build


def _batch(model, rows=2, seq=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 150, (rows, seq), generator=g)
    extra = image_inputs(model)(tokens)
    return extra.pop("input_ids"), extra


@pytest.fixture(scope="module")
def llava():
    model = build("llava", 1).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_tower_is_what_the_token_forward_never_calls(llava):
    trace = fs.trace_forward(llava)
    assert trace.side == ["model.vision_tower", "model.multi_modal_projector"]
    assert trace.blocks == ["model.language_model.layers.0", "model.language_model.layers.1"]


def test_split_with_images_is_the_models_function_and_the_guard_sees_a_dropped_tower(llava, monkeypatch):
    ids, extra = _batch(llava)
    assert split_gap(llava, ids, extra) == 0.0
    own = fs.ForwardStage._model_kwargs
    monkeypatch.setattr(fs.ForwardStage, "_model_kwargs",
                        lambda self, kw: {k: v for k, v in own(self, kw).items() if not k.startswith("pixel")})
    assert split_gap(llava, ids, extra) > 1e-2


def test_image_features_round_trip_is_get_image_features(llava):
    _, extra = _batch(llava)
    tower = ImageFeatures(llava)
    assert {n for n, _ in tower.named_parameters()} == {
        n for n, _ in llava.named_parameters() if n.startswith(("model.vision_tower.", "model.multi_modal_projector."))}
    with torch.no_grad():
        got = tower.unpack(tower(**extra))
        want = llava.model.get_image_features(**extra, return_dict=True)
    assert len(got.pooler_output) == len(want.pooler_output)
    assert all(torch.equal(a, b) for a, b in zip(got.pooler_output, want.pooler_output))


def test_composite_config_shrinks_each_sub_model():
    config = build("paligemma", 4).config
    small = shrink_hf_config(config, [4])
    text, vision = small["text_config"], small["vision_config"]
    assert text["num_attention_heads"] == config.text_config.num_attention_heads
    assert vision["num_attention_heads"] == config.vision_config.num_attention_heads
    assert text["hidden_size"] == 8 * text["num_attention_heads"]
    assert small["projection_dim"] == text["hidden_size"]          # the projector feeds the decoder
    assert small["image_token_index"] < text["vocab_size"]          # the image token stays embeddable
    copy = recipe_for(build("paligemma", 4), [4]).build()
    ids, extra = _batch(copy)
    assert copy(ids, **extra).logits.shape[-1] == text["vocab_size"]


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_pipeline_guard_accepts_vl_families(family):
    assert pipeline_refusal(build(family, 1)) is None
