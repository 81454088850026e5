"""Presets build on meta from config classes, at full width and any depth."""
from __future__ import annotations

import pytest
import torch

from autoplan.presets import UnknownPresetError, build_preset, list_presets, preset_config

REQUIRED = ["llama3-8b", "llama3-70b", "llama3-405b", "qwen2-7b", "qwen2-72b", "mixtral-8x7b", "gpt2-xl",
            "bert-large", "t5-large", "titan-llama3-70b"]


def test_required_presets_listed():
    assert set(REQUIRED) <= set(list_presets())


def test_unknown_preset():
    with pytest.raises(UnknownPresetError, match="llama9"):
        build_preset("llama9")


@pytest.mark.parametrize("name", ["llama3-70b", "titan-llama3-405b"])
def test_full_width_on_meta(name):
    pytest.importorskip("transformers")
    model = build_preset(name, num_layers=2)
    params = list(model.parameters())
    assert all(p.device.type == "meta" for p in params)
    width = 8192 if "70b" in name else 16384
    assert any(p.shape == (128256, width) for p in params)


def test_t5_depth_applies_to_encoder_and_decoder():
    pytest.importorskip("transformers")
    cfg = preset_config("t5-large", num_layers=3)
    assert (cfg.num_layers, cfg.num_decoder_layers, cfg.d_model) == (3, 3, 1024)


def test_param_count_of_full_405b_shape():
    model = build_preset("titan-llama3-405b", dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert 405e9 < n < 406e9


def test_llama3_70b_flops_match_the_model_flops_formula():
    """Forward FLOPs = 2 * (matmul parameters) * tokens + 4 * s^2 * (heads * head_dim) per layer."""
    from autoplan.capture import capture

    layers, batch, seq = 2, 1, 1024
    model = build_preset("titan-llama3-70b", num_layers=layers, dtype=torch.bfloat16)
    g = capture(model, batch=(batch, seq))
    matmul_params = g.num_parameters - model.tok_embeddings.weight.numel() - 8192 * (2 * layers + 1)  # no norms
    attention = 4 * batch * seq * seq * 64 * 128 * layers
    assert g.total_flops() == 2 * matmul_params * batch * seq + attention
    assert g.total_flops(backward=True) == 2 * g.total_flops() + attention // 2  # fused-kernel SDPA backward
