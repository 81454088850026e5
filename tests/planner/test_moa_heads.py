"""A mixture of attention heads (JetMoE's MoA: per-expert query/output projections of stacked 3-D
weights routed by token counts, a shared [k|v] projection) is read from the dataflow as an
attention unit and sharded by heads, or refused naming its heads when tp does not divide them.
The corpus slice (test_model_corpus.py, jetmoe at dp2 x tp2) runs the sharded plan against one
device on gloo ranks."""
import pytest
import torch
import torch.nn as nn
import transformers

from autoplan import MeshSpec, autoplan
from autoplan.capture import capture
from autoplan.errors import InfeasiblePlanError
from autoplan.search.units.structure import model_structure
from hyper_parallel import PairedExpertsParallel, style_from_dict
from hyper_parallel.errors import DivisibilityError, UnsupportedModuleError
from hyper_parallel.local import fake_world
from torch.distributed.device_mesh import init_device_mesh


def _jetmoe(kv_heads: int) -> nn.Module:
    cfg = transformers.JetMoeConfig(num_hidden_layers=2, hidden_size=64, kv_channels=8, num_key_value_heads=kv_heads,
                                    num_attention_heads=2 * kv_heads, intermediate_size=48, num_local_experts=4,
                                    num_experts_per_tok=2, vocab_size=128)
    with torch.device("meta"):
        return transformers.JetMoeForCausalLM(cfg)


@pytest.fixture(scope="module")
def jetmoe6():
    """A JetMoE with 6 KV heads and its graph (captured once: every test here plans the same)."""
    model = _jetmoe(6)
    return model, capture(model, batch=(2, 16))


def test_mixture_of_heads_is_an_attention_unit_with_its_heads_read_from_the_dataflow(jetmoe6):
    att = model_structure(jetmoe6[1]).blocks[0].attention
    assert att is not None and att.moa is not None
    assert (att.n_kv_heads, att.n_heads, att.head_dim) == (6, 12, 8)
    m = att.moa
    assert (m["experts"], m["up"], m["down"], m["kv"], m["kv_packed"]) == (
        "self_attention.experts", "input_linear", "output_linear", ["self_attention.kv_proj"], 2)
    assert (m["up_dims"], m["down_dims"], m["local_attributes"]) == ([1], [2], ["hidden_size"])


@pytest.mark.parametrize("tp", [2, 4])
def test_heads_sharded_where_tp_divides_the_kv_heads_else_refused_naming_them(tp, jetmoe6):
    (model, graph), mesh = jetmoe6, MeshSpec((tp,), ("tp",), "cpu")
    forced = dict(allow_replicated_units=False, sequence_parallel=False, graph=graph)
    if 6 % tp:
        with pytest.raises(InfeasiblePlanError, match=f"self_attention.*KV heads 6.*not divisible by tp={tp}"):
            autoplan(model, mesh, batch=(2, 16), **forced)
        return
    plan = autoplan(model, mesh, batch=(2, 16), **forced)
    assert {d["unit"].split("/")[-1]: d["strategy"] for d in plan.decisions}["attention"] == "heads_sharded"


def test_paired_experts_split_in_whole_heads_with_the_container_width_made_local():
    class MoA(nn.Module):
        def __init__(self, heads):
            super().__init__()
            self.hidden_size = heads * 4
            self.input_linear, self.output_linear = nn.Module(), nn.Module()
            self.input_linear.weight = nn.Parameter(torch.zeros(3, heads * 4, 8))
            self.output_linear.weight = nn.Parameter(torch.zeros(3, 8, heads * 4))

    style = PairedExpertsParallel(up="input_linear", down="output_linear", head_dim=4, local_attributes=["hidden_size"])
    assert style_from_dict(style.to_dict()) == style
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        style.check_module(MoA(8), mesh, "attn.experts")
        with pytest.raises(DivisibilityError, match="heads"):
            style.check_module(MoA(6), mesh, "attn.experts")   # 24 columns divide 4, 6 heads do not
        with pytest.raises(UnsupportedModuleError, match="not an int"):
            PairedExpertsParallel(up="input_linear", down="output_linear",
                                  local_attributes=["nope"]).check_module(MoA(8), mesh, "attn.experts")
