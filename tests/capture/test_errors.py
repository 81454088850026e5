"""Bad input gives typed errors that name the argument or module at fault."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoplan.capture import capture
from autoplan.errors import CaptureError, MissingInputsError, ModelTooLargeError
from autoplan.models import build_llama


def test_no_inputs_and_no_batch():
    with pytest.raises(MissingInputsError, match="batch"):
        capture(build_llama(device="meta"))


def test_real_model_over_copy_limit():
    model = nn.Linear(64, 64)  # 16.6 KB of fp32 on cpu
    with pytest.raises(ModelTooLargeError, match="max_copy_bytes=1000"):
        capture(model, torch.randn(2, 64), max_copy_bytes=1000)


def test_real_model_under_limit_is_copied_not_moved():
    model = build_llama(n_layers=2)
    before = model.layers["0"].attention.wq.weight.clone()
    g = capture(model, batch=(2, 8))
    assert model.layers["0"].attention.wq.weight.device.type == "cpu"
    assert torch.equal(model.layers["0"].attention.wq.weight, before)
    assert g.num_parameters == sum(p.numel() for p in model.parameters())


def test_meta_model_is_restored_after_capture():
    model = build_llama(device="meta", n_layers=4)
    capture(model, batch=(2, 8))
    assert list(model.layers.keys()) == ["0", "1", "2", "3"]


def test_not_a_module_and_bad_batch():
    with pytest.raises(CaptureError, match="nn.Module"):
        capture(lambda x: x, batch=(1, 8))
    with pytest.raises(CaptureError, match="batch="):
        capture(build_llama(device="meta"), batch="big")
