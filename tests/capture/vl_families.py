"""Tiny transformers vision-language models, random weights, by family: ``build(family, width)``
makes one at ``width`` times the small widths (planned wide on meta, checked small on CPU)."""
from __future__ import annotations

import torch
import transformers

from autoplan.capture.image_inputs import derive


def _text(w: int) -> dict:
    return dict(hidden_size=64 * w, intermediate_size=128 * w, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=256, head_dim=16 * w, max_position_embeddings=256, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)


def _vision(w: int, size: int) -> dict:
    return dict(hidden_size=32 * w, intermediate_size=64 * w, num_hidden_layers=2, num_attention_heads=4,
                image_size=size, patch_size=14)


def _config(family: str, w: int, k: int):
    """``k``: images of 28k x 28k pixels (56k for the families that pool patches)."""
    if family == "llava":
        return transformers.LlavaConfig(text_config=dict(model_type="llama", **_text(w)), image_token_index=200,
                                        vision_config=dict(model_type="clip_vision_model", projection_dim=32,
                                                           **_vision(w, 28 * k)), vision_feature_layer=-2)
    if family == "paligemma":
        return transformers.PaliGemmaConfig(text_config=dict(model_type="gemma", **_text(w)), image_token_index=200,
                                            vision_config=dict(model_type="siglip_vision_model", **_vision(w, 28 * k)),
                                            projection_dim=64 * w)
    if family == "gemma3":
        return transformers.Gemma3Config(text_config=dict(model_type="gemma3_text", sliding_window=8, **_text(w)),
                                         vision_config=dict(model_type="siglip_vision_model", **_vision(w, 56 * k)),
                                         image_token_index=200, mm_tokens_per_image=4)
    if family == "internvl":
        return transformers.InternVLConfig(
            text_config=dict(model_type="qwen2", **_text(w)), image_token_id=200, downsample_ratio=0.5,
            vision_config=dict(model_type="internvl_vision", hidden_size=32 * w, intermediate_size=64 * w,
                               num_hidden_layers=2, num_attention_heads=4, image_size=[28 * k, 28 * k], patch_size=[14, 14]))
    if family == "aya_vision":
        return transformers.AyaVisionConfig(text_config=dict(model_type="cohere2", **_text(w)), image_token_index=200,
                                            vision_config=dict(model_type="siglip_vision_model", **_vision(w, 56 * k)),
                                            downsample_factor=2)
    if family == "mistral3":
        return transformers.Mistral3Config(
            text_config=dict(model_type="mistral", **_text(w)), image_token_index=200, spatial_merge_size=2,
            vision_config=dict(model_type="pixtral", hidden_size=32 * w, intermediate_size=64 * w,
                               num_hidden_layers=2, num_attention_heads=4, image_size=56 * k, patch_size=14, head_dim=8 * w))
    if family in ("idefics3", "smolvlm"):
        cls = transformers.Idefics3Config if family == "idefics3" else transformers.SmolVLMConfig
        return cls(text_config=dict(model_type="llama", **_text(w)), image_token_id=200, scale_factor=2,
                   vision_config=dict(hidden_size=32 * w, intermediate_size=64 * w, num_hidden_layers=2,
                                      num_attention_heads=4, image_size=56 * k, patch_size=14))
    if family == "llava_next":
        return transformers.LlavaNextConfig(text_config=dict(model_type="llama", **_text(w)), image_token_index=200,
                                            vision_config=dict(model_type="clip_vision_model", projection_dim=32,
                                                               **_vision(w, 14 * k)),
                                            image_grid_pinpoints=[[14 * k, 14 * k]])
    if family in ("qwen2_vl", "qwen2_5_vl"):
        cls = transformers.Qwen2VLConfig if family == "qwen2_vl" else transformers.Qwen2_5_VLConfig
        mrope = {"type": "mrope", "mrope_section": [2 * w, 3 * w, 3 * w]}   # half the head dim
        text = dict(model_type=f"{family}_text", rope_scaling=mrope, **_text(w))
        vision = dict(depth=2, hidden_size=64 * w, out_hidden_size=64 * w, num_heads=4, in_channels=3, patch_size=14,
                      image_size=28 * k)
        if family == "qwen2_vl":
            vision.update(embed_dim=32 * w, mlp_ratio=2)
        else:   # windowed attention: 56-pixel windows (2x2 merged tokens), the second block full
            vision.update(intermediate_size=128 * w, window_size=56, fullatt_block_indexes=[1])
        return cls(text_config=text, image_token_id=200, vision_config=vision)
    if family == "qwen3_vl":
        rope = {"rope_type": "default", "mrope_section": [2 * w, 3 * w, 3 * w], "rope_theta": 10000.0}
        text = dict(model_type="qwen3_vl_text", rope_parameters=rope, **_text(w))
        return transformers.Qwen3VLConfig(
            text_config=text, image_token_id=200,
            vision_config=dict(depth=2, hidden_size=32 * w, intermediate_size=64 * w, num_heads=4, patch_size=14,
                               out_hidden_size=64 * w, num_position_embeddings=16, deepstack_visual_indexes=[0],
                               image_size=28 * k))
    if family == "mllama":
        return transformers.MllamaConfig(
            vision_config=dict(hidden_size=64 * w, intermediate_size=128 * w, num_hidden_layers=2, num_global_layers=1,
                               attention_heads=4, image_size=28 * k, patch_size=14, vision_output_dim=128 * w,
                               intermediate_layers_indices=[0], max_num_tiles=1, supported_aspect_ratios=[[1, 1]]),
            text_config=dict(hidden_size=64 * w, intermediate_size=128 * w, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=256, cross_attention_layers=[1], pad_token_id=0,
                             bos_token_id=1, eos_token_id=2))
    if family == "florence2":
        return transformers.Florence2Config(
            vision_config=dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                               patch_prenorm=[False, True], embed_dim=[16 * w, 32 * w], num_heads=[2, 4],
                               num_groups=[2, 4], window_size=2, projection_dim=32 * w, drop_path_rate=0.0,
                               max_position_embeddings=16),
            text_config=dict(vocab_size=128, d_model=32 * w, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64 * w,
                             decoder_ffn_dim=64 * w, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                             activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                             decoder_start_token_id=2),
            image_token_id=100)
    raise KeyError(family)


# the families with one pixel tensor per image (planned from their config alone), then those
# autoplan refuses without a hook (image grids, tiling, cross-attention, no image size)
FAMILIES = ("llava", "paligemma", "gemma3", "internvl", "aya_vision", "mistral3", "idefics3", "smolvlm",
            "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "mllama", "florence2")


def build(family: str, width: int = 1, image: int = 1) -> torch.nn.Module:
    config = _config(family, width, image)
    return transformers.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)](config)


# what a processor gives a model, and nothing autoplan derives besides (rotary positions, window
# order, packed segment bounds): the inputs a user's extra_inputs hook returns
PROCESSOR_KEYS = ("input_ids", "pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask")


def processor_hook(model: torch.nn.Module):
    """An ``extra_inputs(tokens)`` hook as a user writes one from a processor's output: the image
    tokens placed, the pixel tensors, the grid (with the token types M-RoPE reads) or the image
    sizes -- every tensor on the tokens' device (meta when planning on meta), the sizes as tensors."""
    batch = derive(model)

    def hook(tokens: torch.Tensor) -> dict:
        out = {k: v for k, v in batch(tokens).items() if k in PROCESSOR_KEYS}
        if "image_grid_thw" in out:   # M-RoPE's token types, as a Qwen-VL processor returns them
            out["mm_token_type_ids"] = (out["input_ids"] == batch.token_id).int()
        if isinstance(out.get("image_sizes"), list):
            out["image_sizes"] = torch.tensor(out["image_sizes"])
        return {k: v.to(tokens.device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    return hook


def build_with_hook(family: str, width: int = 1, image: int = 1) -> torch.nn.Module:
    """``build`` with :func:`processor_hook` installed as ``model.extra_inputs``."""
    model = build(family, width, image)
    model.extra_inputs = processor_hook(model)
    return model
