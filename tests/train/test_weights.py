"""Meta first: the model is built on meta, the plan applied there, and only then each
rank's shards get memory and values -- the seed's initial weights, or a save_pretrained
directory's -- and trained state goes back out as a directory ``from_pretrained`` loads.

Checked on the session's 4-rank gloo pool under tp=4, dp=2 x tp=2 with FSDP and pp=2 x tp=2:
- initial weights gathered after meta init equal one device's (``build_model(seed)``) bit for
  bit: the repo Llama and three transformers families (Phi-3: packed projections);
- a save_pretrained checkpoint (one fp32 file; a sharded bf16 index, tied embeddings; Phi-3's
  packed projections, whose strided shards torch DCP cannot map) trains
  from its weights: the step-0 loss equals ``from_pretrained`` on one device (rtol 1e-5), so do
  the next losses and every parameter after 5 steps (one device trained the same way), and
  after the steps the exported directory reloads to exactly the gathered parameters -- written by
  the ranks (``runner.export_hf``) and by ``autoplan export-hf`` from a training checkpoint;
- a checkpoint of another shape, with a tensor missing, truncated, or with an index naming a
  missing file is refused with PretrainedWeightsError on every rank before training.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from autoplan import plan_cluster
from autoplan.cli import main
from autoplan.errors import PretrainedWeightsError
from autoplan.plan.forward import lm_loss
from autoplan.train.data import token_stream
from autoplan.train.model import build_model
from hyper_parallel.core.materialize import InitSources, default_init_fn, materialize
from hyper_parallel.errors import InitError
from tests.train import weights_workers
from tests.train.train_workers import differences

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=256)
PHI3 = dict(SMALL, pad_token_id=0, eos_token_id=1, bos_token_id=1)   # packed qkv_proj / gate_up_proj
# HF Qwen3 stands for HF Llama too: the same modules plus per-head q/k norms
MODELS = {"titan-llama-debug": {}, "hf:qwen3": dict(SMALL, head_dim=16), "hf:phi3": PHI3}
PLANS = {"tp4": dict(dp=1, tp=4, pp=1), "dp2tp2": dict(dp=2, tp=2, pp=1, fsdp=True), "pp2tp2": dict(dp=1, pp=2, tp=2)}


def _plan(meta, cons):
    return plan_cluster(meta, 4, hardware="cpu", batch=(8, 16), devices_per_node=4, constraints=cons,
                        allow_replicated_units=False, dtype=torch.float32)


@pytest.mark.parametrize("model", list(MODELS))
def test_initial_weights_do_not_depend_on_the_plan(model, pool4):
    overrides = MODELS[model]
    meta = build_model(model, overrides=overrides, device="meta")
    one_device = {f"model.{k}": v for k, v in build_model(model, overrides=overrides, seed=3).state_dict().items()}
    for name, cons in PLANS.items():
        got = pool4.run(weights_workers.materialized_state, model, overrides, _plan(meta, cons).to_json(), 3)[0]
        assert differences(one_device, got) == [], (model, name)


def test_a_module_without_an_init_is_refused_by_name():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.empty(4))

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), Scaled())
    with pytest.raises(InitError, match="Scaled has tensors \\['scale'\\]"):
        materialize(model, InitSources.of(model), default_init_fn(model), device="cpu")
    with pytest.raises(InitError, match="left param 'weight' of module '0' \(Linear\)"):
        materialize(model, InitSources.of(model), lambda m: None, device="cpu")

    def init(m):
        if isinstance(m, torch.nn.Linear):
            m.reset_parameters()
        else:
            m.scale.fill_(2.0)
    materialize(model, InitSources.of(model), init, device="cpu", seed=1)
    assert torch.equal(model[1].scale, torch.full((4,), 2.0)) and not model[0].weight.isnan().any()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An HF Llama in one fp32 file and a Qwen3 (tied embeddings) as a bf16 sharded index."""
    d = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(5)
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL))
    llama.save_pretrained(d / "llama_fp32")
    qwen = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**SMALL, head_dim=16,
                                                                                  tie_word_embeddings=True))
    qwen.to(torch.bfloat16).save_pretrained(d / "qwen_bf16", max_shard_size="40KB")
    assert (d / "qwen_bf16/model.safetensors.index.json").is_file()
    transformers.AutoModelForCausalLM.from_config(transformers.Phi3Config(**PHI3)).save_pretrained(d / "phi3_fp32")
    plans = {}
    for ck in ("llama_fp32", "qwen_bf16", "phi3_fp32"):
        meta = build_model(str(d / ck), device="meta")
        for name, cons in PLANS.items():
            plans[ck, name] = d / f"{ck}_{name}.json"
            _plan(meta, cons).to_json(plans[ck, name])
    return d, plans


def _one_device_run(path: Path, steps: int, lr: float) -> tuple[list[float], dict]:
    """``from_pretrained`` on one device, trained as the Trainer trains (AdamW, betas 0.9/0.95, the
    same token stream): its losses and its parameters after ``steps``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    data = token_stream("synthetic", batch=8, seq=16, vocab=model.config.vocab_size, seed=0)
    opt = torch.optim.AdamW(list(model.parameters()), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    losses = []
    for _ in range(steps):
        x, y = data.next()
        opt.zero_grad()
        loss = lm_loss(model(x).logits, y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def test_pretrained_weights_train_and_export_under_every_plan(checkpoints, pool4):
    d, plans = checkpoints
    runs = [{"model": str(d / ck), "plan": str(plans[ck, p]), "export": str(d / f"out_{ck}_{p}")}
            for ck in ("llama_fp32", "qwen_bf16") for p in PLANS]
    runs.insert(0, {"model": str(d / "phi3_fp32"), "plan": str(plans["phi3_fp32", "dp2tp2"]),
                    "export": str(d / "out_phi3_dp2tp2")})   # packed projections under FSDP x TP
    runs[-1]["checkpoint_dir"] = str(d / "ckpt")   # and a training checkpoint for autoplan export-hf
    results = pool4.run(weights_workers.train_pretrained, runs, 5, 1e-3)[0]
    for run, res in zip(runs, results):
        one_losses, one_state = _one_device_run(Path(run["model"]), 5, 1e-3)
        assert res["losses"][0] == pytest.approx(one_losses[0], rel=1e-5), run
        assert res["losses"] == pytest.approx(one_losses, rel=1e-5), run   # every step, against one device
        for k, v in res["state"].items():   # every parameter after 5 steps
            # AdamW turns a gradient near zero into a step of ~lr whatever its size, so an element whose
            # gradient is reduction-order noise may move by up to lr (measured: 1 element in ~4k, 1.3e-4);
            # the rest must agree as gradients do
            diff = (v - one_state[k]).abs()
            assert float(diff.max()) <= 1e-3 and float(diff.mean()) < 1e-6, (run, k, float(diff.max()))
        assert len(res["losses"]) == 5 and res["losses"][-1] < res["losses"][0], res["losses"]
        back = transformers.AutoModelForCausalLM.from_pretrained(run["export"], dtype=torch.float32)
        reloaded = {k: v for k, v in back.state_dict().items() if k in res["state"]}
        assert set(res["state"]) == set(back.state_dict()), run
        assert differences(res["state"], reloaded) == [], run
    assert main(["export-hf", str(d / "ckpt/step-5"), "--out", str(d / "from_ckpt")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(d / "from_ckpt", dtype=torch.float32).state_dict()
    assert differences(results[-1]["state"], {k: v for k, v in back.items() if k in results[-1]["state"]}) == []


def test_mismatching_checkpoints_are_refused_before_training(checkpoints, pool4):
    d, plans = checkpoints
    good = d / "llama_fp32"
    cases = {}
    torch.manual_seed(0)
    other = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**dict(SMALL, intermediate_size=96)))
    other.save_pretrained(d / "shape")
    shutil.copy(good / "config.json", d / "shape/config.json")   # the config says 128, the tensors 96
    cases["shape"] = d / "shape"
    from safetensors.torch import load_file, save_file
    missing = d / "missing"
    shutil.copytree(good, missing)
    tensors = load_file(missing / "model.safetensors")
    tensors.pop("model.layers.1.self_attn.v_proj.weight")
    save_file(tensors, missing / "model.safetensors", metadata={"format": "pt"})
    cases["missing"] = missing
    truncated = d / "truncated"
    shutil.copytree(good, truncated)
    blob = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    cases["truncated"] = truncated
    lost = d / "lost_part"
    shutil.copytree(d / "qwen_bf16", lost)
    sorted(lost.glob("model-*.safetensors"))[1].unlink()
    cases["lost_part"] = lost
    plan_of = {"lost_part": str(plans["qwen_bf16", "pp2tp2"])}
    results = pool4.run(weights_workers.refused_checkpoints,
                        {k: (str(v), plan_of.get(k, str(plans["llama_fp32", "dp2tp2"]))) for k, v in cases.items()})
    for rank_result in results:   # every rank refuses the same way
        assert rank_result == results[0]
    r = results[0]
    assert r["shape"]["name"] == "model.layers.0.mlp.gate_proj.weight"
    assert tuple(r["shape"]["expected"]) == (128, 64) and tuple(r["shape"]["found"]) == (96, 64)
    assert r["missing"]["name"] == "model.layers.1.self_attn.v_proj.weight" and "(64, 64)" in r["missing"]["message"]
    assert r["truncated"]["file"] == "model.safetensors" and "truncated" in r["truncated"]["message"]
    assert r["lost_part"]["error"] == "PretrainedWeightsError" and r["lost_part"]["file"].startswith("model-")
    with pytest.raises(PretrainedWeightsError):   # the same check in this process, no ranks
        from autoplan.plan.pretrained import read_headers
        read_headers(truncated)


def test_packed_projections_checkpoint_and_resume_across_plans(checkpoints, pool4):
    """Phi-3's packed qkv/gate_up shards are strided: a training checkpoint of them must save (DCP
    refused "overlapping chunks") and resume under another plan to exactly the saved state."""
    d, plans = checkpoints
    order = [str(plans["phi3_fp32", p]) for p in ("tp4", "dp2tp2", "pp2tp2")]
    res = pool4.run(weights_workers.packed_resume, str(d / "phi3_fp32"), order, str(d / "phi3_ckpt"))[0]
    for plan in order[1:]:
        assert res[plan]["step"] == 2
        assert differences(res["saved"], res[plan]["state"]) == [], plan
