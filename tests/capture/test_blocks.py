"""Repeated-block recognition from the module tree, before anything is traced."""
from __future__ import annotations

import torch
import torch.nn as nn

from autoplan.capture import capture
from autoplan.capture.blocks import find_blocks
from autoplan.models import build_llama


def test_setting_equal_to_an_index_is_not_a_difference():
    # n_kv_heads == 2 equals the index of layer 2; only settings equal to *every* layer's index
    # (layer_idx) are ignored, so the three layers stay one group
    groups = find_blocks(build_llama(device="meta", n_layers=3, n_kv_heads=2))
    assert [(g.prefix, g.count) for g in groups] == [("layers", 3)]


class Odd(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(8, width)
        self.back = nn.Linear(width, 8)

    def forward(self, x):
        return x + self.back(self.proj(x))


class Mixed(nn.Module):
    """Layers 0, 2, 3 alike; layer 1 wider: two groups, both traced once."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Odd(16), Odd(32), Odd(16), Odd(16)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_distinct_blocks_form_groups_and_keep_their_index():
    with torch.device("meta"):
        model = Mixed()
    g = capture(model, torch.empty(2, 8, device="meta"))
    assert sorted((b.indices, b.count) for b in g.blocks) == [(["0", "2", "3"], 3), (["1"], 1)]
    assert {n.module for n in g.nodes} == {"layers.0.proj", "layers.0.back", "layers.1.proj", "layers.1.back",
                                           "layers.0", "layers.1"}
    assert g.total_flops() == 3 * 2 * (2 * 2 * 8 * 16) + 2 * (2 * 2 * 8 * 32)
    assert len(model.layers) == 4 and model.training  # the model is given back as it was


def test_dtype_casts_parameters_and_inputs():
    model = build_llama(device="meta", n_layers=2)
    g32 = capture(model, batch=(2, 8))
    g16 = capture(model, batch=(2, 8), dtype=torch.bfloat16)
    lin32 = next(n for n in g32.nodes if n.module == "layers.0.attention.wq")
    lin16 = next(n for n in g16.nodes if n.module == "layers.0.attention.wq")
    assert lin16.outputs[0].dtype == "torch.bfloat16"
    assert lin16.bytes_read * 2 == lin32.bytes_read
    assert next(model.parameters()).dtype == torch.float32  # the user's model is not cast


def test_stack_of_one_layer_class_is_grouped_even_when_all_differ():
    with torch.device("meta"):
        stack = nn.Module()
        stack.layers = nn.ModuleList([Odd(16), Odd(32)])
        stack.heads = nn.ModuleList([nn.Linear(8, 2), nn.Conv1d(8, 2, 1)])  # mixed classes: not a stack
    assert sorted((g.prefix, g.indices) for g in find_blocks(stack)) == [("layers", ["0"]), ("layers", ["1"])]
