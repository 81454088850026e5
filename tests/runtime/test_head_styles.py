"""PrepareHeadsInput as data and at its boundary: typed errors naming the attribute, nothing
changed on failure (the shared config object included), no torch equivalent."""
import json
import types

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from hyper_parallel import ColwiseParallel, PrepareHeadsInput, Replicate, parallelize_module, style_from_dict
from hyper_parallel.core.tensor_parallel import to_torch_style
from hyper_parallel.errors import DivisibilityError, LayoutError, StyleSpecError
from hyper_parallel.local import fake_world

R = (Replicate(),)


def style(*paths):
    return PrepareHeadsInput(input_layouts=R, desired_input_layouts=R, local_attributes=list(paths))


class Attn(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config, self.num_heads, self.hidden_size = config, config.num_heads, 32
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        return self.qkv(x)


def model():
    config = types.SimpleNamespace(num_heads=8, vocab_size=10)
    m = nn.Module()
    m.config, m.attn = config, Attn(config)
    return m


@pytest.fixture(scope="module")
def mesh4():
    with fake_world(4):
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))


def test_round_trip_and_paths_sorted_once():
    s = style("num_heads", "config.num_heads", "num_heads")
    assert s.local_attributes == ["config.num_heads", "num_heads"]
    back = style_from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s and type(back) is PrepareHeadsInput


@pytest.mark.parametrize("paths", [[], ["a.b.c"], ["1x"], [3], "num_heads"])
def test_bad_paths_are_refused_at_construction(paths):
    with pytest.raises(StyleSpecError, match="local_attributes"):
        PrepareHeadsInput(input_layouts=R, desired_input_layouts=R, local_attributes=paths)


def test_no_torch_equivalent():
    with pytest.raises(StyleSpecError, match="no torch equivalent"):
        to_torch_style(style("num_heads"))


def test_apply_sets_local_values_on_a_private_config(mesh4):
    m = model()
    shared = m.config
    parallelize_module(m, mesh4, {"attn": style("config.num_heads", "num_heads", "hidden_size"),
                                  "attn.qkv": ColwiseParallel()})
    assert (m.attn.num_heads, m.attn.config.num_heads, m.attn.hidden_size) == (2, 2, 8)
    assert m.config is shared and shared.num_heads == 8 and m.attn.config is not shared


@pytest.mark.parametrize("paths, error, match", [
    (["num_kv_heads"], LayoutError, "has no attribute 'num_kv_heads'"),
    (["config.vocab_size"], DivisibilityError, "config.vocab_size"),
    (["qkv.in_features"], LayoutError, "goes through a submodule"),
])
def test_bad_attribute_refused_before_anything_changes(mesh4, paths, error, match):
    m = model()
    with pytest.raises(error, match=match):
        parallelize_module(m, mesh4, {"attn": style("num_heads", *paths), "attn.qkv": ColwiseParallel()})
    assert m.attn.num_heads == 8 and m.attn.config is m.config
    assert type(m.attn.qkv.weight) is nn.Parameter


def test_failure_while_applying_restores_counts_and_config(mesh4):
    """A failure after this style applied (a style whose apply raises) rolls the attributes back."""
    m = model()

    class Boom(ColwiseParallel):
        def apply(self, module, mesh, record, fqn=""):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        parallelize_module(m, mesh4, {"attn": style("config.num_heads", "num_heads"), "attn.qkv": Boom()})
    assert m.attn.num_heads == 8 and m.attn.config is m.config and m.config.num_heads == 8


def test_folded_heads_round_trips_and_must_name_a_local_attribute():
    s = PrepareHeadsInput(input_layouts=R, desired_input_layouts=R, local_attributes=["num_heads"],
                          folded_heads="num_heads")
    back = style_from_dict(json.loads(json.dumps(s.to_dict())))
    assert back == s and back.folded_heads == "num_heads"
    with pytest.raises(StyleSpecError, match="folded_heads='n_head' must be one of local_attributes"):
        PrepareHeadsInput(input_layouts=R, desired_input_layouts=R, local_attributes=["num_heads"],
                          folded_heads="n_head")


class BiasedAttn(nn.Module):
    """Adds a per-head bias passed in with heads folded into the batch (Bloom's ALiBi)."""

    def __init__(self):
        super().__init__()
        self.num_heads = 8
        self.seen = {}

    def forward(self, x, bias, mask=None, *, alibi=None):
        self.seen = {"bias": tuple(bias.shape), "alibi": tuple(alibi.shape), "mask": tuple(mask.shape)}
        return x, bias, alibi


def test_folded_inputs_keep_the_ranks_heads_rows(mesh4):
    m = nn.Module()
    m.attn = BiasedAttn()
    parallelize_module(m, mesh4, {"attn": PrepareHeadsInput(input_layouts=R, desired_input_layouts=R,
                                                            local_attributes=["num_heads"], folded_heads="num_heads")})
    b, heads = 3, 8
    bias = torch.arange(b * heads, dtype=torch.float32).reshape(b * heads, 1, 1)
    mask = torch.zeros(b, 1, 5)       # leading dim is the batch, not batch x heads: untouched
    _, got_bias, got_alibi = m.attn(torch.zeros(b, 5, 4), bias, mask, alibi=bias.clone())
    rank = mesh4.get_local_rank()
    want = bias.reshape(b, heads)[:, rank * 2:(rank + 1) * 2].reshape(b * 2, 1, 1)
    assert torch.equal(got_bias, want) and torch.equal(got_alibi, want)
    assert m.attn.seen["mask"] == (b, 1, 5)
