"""Per-head parameters an attention module holds itself (GPT-OSS's learnable sinks: one extra logit
per head, concatenated to that head's scores) sharded with the heads (PrepareHeadsInput
``head_params``: a Shard(0) DTensor, the module's code seeing this rank's rows). Before, every
tensor-parallel form of GPT-OSS's attention failed its probe run (the whole sinks met the rank's
heads) and its attention stayed replicated. Planned with replicated units forbidden, heads
sharded on a replicated stream and kv-replicated (fewer KV heads than ranks) on a sequence-sharded one, one SGD step on a small copy on
gloo ranks equals one device (loss rtol 1e-5, every gradient -- the sinks' among them -- rtol 1e-4),
and the collectives each plan predicts are the ones a dry run issues."""
import pytest
import torch
import torch.nn as nn
import transformers
from torch.distributed.device_mesh import init_device_mesh

from autoplan import MeshSpec, autoplan
from autoplan.verify.dry_run import verify
from autoplan.verify.numerics import check_numerics
from autoplan.verify.shrink import recipe_for
from hyper_parallel import PrepareHeadsInput, style_from_dict
from hyper_parallel.core.tensor_parallel.base import ApplyRecord
from hyper_parallel.errors import DivisibilityError, LayoutError, StyleSpecError
from hyper_parallel.local import fake_world


def _gpt_oss(kv_heads: int):
    cfg = transformers.GptOssConfig(num_hidden_layers=2, hidden_size=512, intermediate_size=256,
                                    num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=64,
                                    num_local_experts=4, num_experts_per_tok=2, vocab_size=2048,
                                    max_position_embeddings=1024, sliding_window=128)
    with torch.device("meta"):
        return transformers.GptOssForCausalLM(cfg)


# the sequence-sharded stream: benchmarks/model_corpus.py's forced_S cases (gpt_oss, tp4 and dp2 x tp2)
@pytest.mark.parametrize("kv_heads,tp,sequence_parallel,form", [
    (2, 2, False, "heads_sharded"), (1, 2, True, "kv_replicated")], ids=["R", "kv_replicated_S"])
def test_gpt_oss_sinks_shard_with_heads_equal_one_device(kv_heads, tp, sequence_parallel, form, pool2):
    model = _gpt_oss(kv_heads)
    plan = autoplan(model, MeshSpec((tp,), ("tp",), "h100_sxm"), batch=(2, 512), allow_replicated_units=False,
                    sequence_parallel=sequence_parallel)
    picked = {d["unit"].split("/")[-1]: d["strategy"] for d in plan.decisions}
    assert picked["attention"] == form, picked
    prep = plan.styles["model.layers.*.self_attn"]
    assert prep["style"] == "PrepareHeadsInput" and prep["args"]["head_params"] == ["sinks"], prep
    result = check_numerics(plan, recipe_for(model, [tp], seed=5), pool=pool2)
    assert result.passed, result.summary()
    dry = verify(plan, model)
    assert dry.passed, dry.mismatches()


class _Sinks(nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        self.sinks = nn.Parameter(torch.arange(float(heads)))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.sinks.sum()


def test_head_params_are_sharded_rows_the_forward_sees_locally():
    with fake_world(2, rank=1):
        mesh = init_device_mesh("cpu", (2,))
        m = _Sinks()
        seen = []
        inner = m.forward
        m.forward = lambda x: seen.append(m.sinks.shape) or inner(x)
        style = PrepareHeadsInput(head_params=["sinks"])
        style.check_module(m, mesh, "attn")
        record = ApplyRecord(src_data_rank=None)   # keep local values (a fake group scatters nothing)
        style.apply(m, mesh, record, "attn")
        assert m.sinks.placements[0].dim == 0 and m.sinks.to_local().tolist() == [2.0, 3.0]
        out = m(torch.ones(2))
        assert seen == [(2,)] and out.tolist() == [5.0, 5.0]   # this rank's heads' rows, a plain tensor
        out.sum().backward()
        assert m.sinks.grad.to_local().tolist() == [2.0, 2.0]
        record.rollback()
        assert not hasattr(m.sinks, "placements") and m.sinks.shape == (4,)
        assert style.param_shard_dims({"sinks": (4,), "scale": (3,)}) == {"sinks": (0, False)}


def test_head_params_arguments_are_checked():
    for bad in ([], "sinks", ["a.b"], [3]):
        with pytest.raises(StyleSpecError):
            PrepareHeadsInput(head_params=bad)
    with pytest.raises(StyleSpecError):
        PrepareHeadsInput(head_params=["sinks"], local_attributes=["num_heads"], head_count=5)
    style = PrepareHeadsInput(head_params=["sinks"])
    assert style_from_dict(style.to_dict()) == style
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        with pytest.raises(LayoutError, match="scales"):
            PrepareHeadsInput(head_params=["scales"]).check_module(_Sinks(), mesh, "attn")
        with pytest.raises(DivisibilityError):
            PrepareHeadsInput(head_params=["sinks"]).check_module(_Sinks(heads=6), mesh, "attn")
