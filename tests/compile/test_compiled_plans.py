"""A plan compiled (per block and whole, ``aot_eager``) trains as the same plan in eager and as one
device: a tiny HF Llama planned at tp=2 and at dp=2 x tp=2 (FSDP) with every unit sharded, the
way a user plans it inside a job. Before the runtime's fixes these were a crash (tp=2 per block),
a crash (dp=2 x tp=2 whole: 'Mixing fake modes') and a silently different model (dp=2 x tp=2 per
block: the embedding's gradient lost) -- see docs/compile.md."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autoplan import autoplan
from autoplan.verify.compiled import check_compiled
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.parallel_dims import ParallelDims

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
SPECS = [{"mode": "blocks", "backend": "aot_eager"}, {"mode": "model", "backend": "aot_eager"}]


def plan_and_recipe(shape, names):
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**CONFIG))
    plan = autoplan(meta, ParallelDims(shape, names, "cpu"), hardware="cpu", allow_replicated_units=False,
                    batch=(4, 16))
    recipe = ModelRecipe(hf_config={**LlamaConfig(**CONFIG).to_dict(), "model_class": "LlamaForCausalLM"}, seed=3)
    return plan, recipe


@pytest.mark.timeout(900)   # two compiles per case: ~1 min on an idle 2-core CPU, several under load
@pytest.mark.parametrize("shape,names,pool", [((2,), ("tp",), "pool2"), ((2, 2), ("dp", "tp"), "pool4")],
                         ids=["tp2", "dp2_tp2"])
def test_compiled_equals_eager_and_one_device(shape, names, pool, request):
    plan, recipe = plan_and_recipe(shape, names)
    result = check_compiled(plan, recipe, SPECS, pool=request.getfixturevalue(pool), global_batch=4, steps=2,
                            one_device=True)
    assert result.error is None, result.error
    eager = result.settings.get("eager", {})
    assert not eager.get("error"), eager
    for name in ("blocks/aot_eager", "model/aot_eager"):
        r = result.settings[name]
        assert r["error"] is None, (name, r["error"], r.get("trace"))
        assert r["loss_rel"] <= 1e-6, (name, r)
        assert r["param_mean_abs"] <= 1e-8, (name, r)
        assert r["one_device_off"] == [], (name, r["one_device_off"])   # and equal to one device
        assert r["stats"]["graphs"] >= 1, (name, r)
    assert result.settings["blocks/aot_eager"]["stats"]["graph_breaks"] == 0
    if len(shape) == 1:   # TP only: the whole model is one graph per direction, no break
        assert result.settings["model/aot_eager"]["stats"]["graph_breaks"] == 0
