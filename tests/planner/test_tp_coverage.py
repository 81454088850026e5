"""Shapes the planner used to leave replicated or misread, at the capture/structure
level -- the corpus slice (test_model_corpus.py) runs the sharded ones against one device.

A state-space mixer (Falcon-H1's Mamba-2: in_proj -> depthwise conv -> scan -> gated out_proj)
must not read as a gated MLP: sharding it as one would cut its packed z/x/B/C/dt columns blindly.
It is recognised as its own unit (Jamba's Mamba-1 mixers are split on their channels, Falcon-H1's
Mamba-2 on its heads: the corpus slice), and the block's real MLP is planned. A model
capture cannot trace at all is planned data-parallel only -- and refused, naming the capture
failure, when the user asks for tensor parallelism that cannot happen."""
import pytest
import torch
import torch.nn as nn
import transformers

from autoplan import MeshSpec, autoplan
from autoplan.capture import capture
from autoplan.errors import InfeasiblePlanError
from autoplan.search.units.structure import model_structure
from hyper_parallel import FlatExpertsParallel, PairedExpertsParallel, PrepareHeadsInput, style_from_dict
from hyper_parallel.core.tensor_parallel.mamba_styles import MambaMixerParallel
from hyper_parallel.errors import DivisibilityError, StyleSpecError, UnsupportedModuleError
from hyper_parallel.local import fake_world
from torch.distributed.device_mesh import init_device_mesh


def test_mamba_mixer_is_recognised_and_the_feed_forward_is_the_mlp():
    cfg = transformers.FalconH1Config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                      mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16,
                                      mamba_chunk_size=16)
    with torch.device("meta"):
        model = transformers.FalconH1ForCausalLM(cfg)
    graph = capture(model, batch=(1, 32), dtype=torch.float32)
    roles = graph.blocks[0].roles
    assert [m["module"] for m in roles["mamba"]] == ["mamba"], roles
    assert [m["module"] for m in roles["mlp"]] == ["feed_forward"], roles
    st = model_structure(graph)
    block = st.blocks[0]
    assert block.mlp.rel == "feed_forward" and block.attention.rel == "self_attn"
    assert block.mamba.rel == "mamba" and block.mamba.channels == 64 + 2 * 16   # conv over [x | B | C]
    assert not any(n.startswith("mamba") for n in block.norms), block.norms   # its gated norm is the mixer's
    # a Mamba-2 mixer is split on its heads; one group is read whole by every rank -- unless a gated norm
    # normalises over it (it would span ranks): refused, naming the groups
    mixer = model.model.layers[0].mamba
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        MambaMixerParallel().check_module(mixer, mesh, "model.layers.0.mamba")
        with torch.device("meta"):
            normed = transformers.FalconH1ForCausalLM(cfg.__class__(**{**cfg.to_dict(), "mamba_rms_norm": True}))
        mixer = normed.model.layers[0].mamba
        with pytest.raises(DivisibilityError, match="1 groups .n_groups. do not divide tp=2"):
            MambaMixerParallel().check_module(mixer, mesh, "model.layers.0.mamba")


class _CountRouted(nn.Module):
    """Splits tokens by counts read from the data (JetMoE-like): neither export nor hooks trace it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.head = nn.Linear(32, 16)

    def forward(self, input_ids):
        h = self.emb(input_ids)
        counts = torch.bincount(input_ids.flatten() % 4, minlength=4).tolist()
        parts = h.reshape(-1, 32).split(counts)
        h = torch.cat([p * (i + 1) for i, p in enumerate(parts)]).reshape(h.shape)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_a_model_capture_cannot_trace_is_refused_when_tp_is_asked_for():
    model = _CountRouted()
    mesh = MeshSpec((2,), ("tp",), "cpu")
    plan = autoplan(model, mesh, batch=(2, 8))          # planned data-parallel only, with the reason
    assert any("capture could not trace" in n for n in plan.notes), plan.notes
    for forced in ({"allow_replicated_units": False}, {"sequence_parallel": True}):
        with pytest.raises(InfeasiblePlanError, match="capture could not trace _CountRouted"):
            autoplan(model, mesh, batch=(2, 8), **forced)


def test_flat_experts_and_divisor_styles_check_their_arguments():
    class Experts(nn.Module):
        def __init__(self, rows, ffn):
            super().__init__()
            self.mlp = nn.Module()
            for name in ("w1", "v1", "w2"):
                setattr(self.mlp, name, nn.Parameter(torch.zeros(rows, 8)))
            self.ffn_hidden_size = ffn

    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        FlatExpertsParallel().check_module(Experts(4 * 8, 8), mesh, "ffn.experts")
        with pytest.raises(UnsupportedModuleError, match="not a multiple"):
            FlatExpertsParallel().check_module(Experts(30, 8), mesh, "ffn.experts")
        with pytest.raises(DivisibilityError, match="ffn_hidden_size"):
            FlatExpertsParallel().check_module(Experts(4 * 6, 6), mesh, "ffn.experts")
    with pytest.raises(StyleSpecError, match="attribute_divisors"):
        PrepareHeadsInput(local_attributes=["num_heads"], attribute_divisors={"num_key_value_groups": 2})


def test_paired_experts_style_checks_its_pair_and_round_trips():
    """JetMoE-shaped experts: an up module (E, 2F, H) and a down module (E, H, F) in one container."""
    class Pair(nn.Module):
        def __init__(self, ffn):
            super().__init__()
            self.input_linear, self.output_linear = nn.Module(), nn.Module()
            self.input_linear.weight = nn.Parameter(torch.zeros(3, 2 * ffn, 8))
            self.output_linear.weight = nn.Parameter(torch.zeros(3, 8, ffn))

    style = PairedExpertsParallel(up="input_linear", down="output_linear", packed=2)
    assert style_from_dict(style.to_dict()) == style   # a plan file names it
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        style.check_module(Pair(8), mesh, "mlp")
        with pytest.raises(DivisibilityError, match="expert ffn width F = 6"):
            style.check_module(Pair(6), mesh, "mlp")
        with pytest.raises(UnsupportedModuleError, match="not E experts"):
            PairedExpertsParallel(up="input_linear", down="output_linear").check_module(Pair(8), mesh, "mlp")
    with pytest.raises(StyleSpecError, match="two submodules"):
        PairedExpertsParallel(up="x", down="x")
