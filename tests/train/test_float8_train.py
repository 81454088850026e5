"""`autoplan train --precision fp8-tensorwise` under torchrun: float8 training, its checkpoint resumed
under another plan, and `export-hf` of the float8 run loaded back by `from_pretrained`.

Two torchrun launches on 4 gloo ranks, a 2-layer HF Llama written with ``save_pretrained``:
(dp=2, tp=2) FSDP with the weights gathered in float8 trains 4 steps saving step 2; (dp=4) FSDP,
also float8-gathered, resumes step 2 and trains steps 3 and 4, saving and exporting. The gathered weights
and the optimizer state made from them are torchao wrapper tensors; they once reached DCP as such
(pickled objects the guarded loads refuse, and an export that crashed), so the checkpoint and the
export must hold the plain float32 master weights under the model's own names.
"""
from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from autoplan.train.checkpoint import consolidated
from tests.train.test_train_torchrun import _run, _torchrun

FLOAT8_LINE = re.compile(r"float8: 14 Linears on this rank \(tensorwise 14; emulated\), 14 weights gathered in float8")


def _train(model, work, name: str, constraints: str, *extra: str):
    return _run(_torchrun(4, "-m", "autoplan.cli", "train", "--model", str(model), "--constraints", constraints,
                          "--precision", "fp8-tensorwise", "--batch", "4", "--seq", "32", "--steps", "4",
                          "--lr", "1e-3", "--metrics", str(work / f"{name}.jsonl"), "--progress", "log", *extra))


def _losses(path):
    return [json.loads(line)["loss"] for line in open(path)]


def test_float8_run_checkpoints_resumes_under_another_plan_and_exports(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64)
    initial = transformers.LlamaForCausalLM(config)
    initial.save_pretrained(tmp_path / "model")

    a = _train(tmp_path / "model", tmp_path, "a", "dp=2,tp=2,pp=1,fsdp=true", "--shard-all",
               "--checkpoint-dir", str(tmp_path / "ckpt_a"), "--checkpoint-every", "2")
    b = _train(tmp_path / "model", tmp_path, "b", "dp=4,tp=1,pp=1,fsdp=true",
               "--checkpoint-dir", str(tmp_path / "ckpt_b"), "--checkpoint-every", "1",
               "--resume", str(tmp_path / "ckpt_a/step-2"), "--export-hf", str(tmp_path / "exported"))
    for out in (a, b):   # what the runtime holds, counted on rank 0: float8 really ran
        assert FLOAT8_LINE.search(out.stderr), out.stderr[-3000:]
        assert "WARNING" not in out.stderr and "UserWarning" not in out.stderr, out.stderr[-3000:]
    assert "resumed from" in b.stderr and "step-2" in b.stderr
    # the resumed float8 run continues as the uninterrupted one (another mesh, the same global float8
    # scales; step 4 also reads the AdamW state the checkpoint held)
    assert _losses(tmp_path / "b.jsonl") == pytest.approx(_losses(tmp_path / "a.jsonl")[2:], rel=1e-4)   # steps 3, 4

    names = {f"model.{k}" for k in initial.state_dict()}
    for step in (tmp_path / "ckpt_a/step-2", tmp_path / "ckpt_b/step-4"):
        saved = {k: v for k, v in consolidated(step).items() if k.startswith("model.")}
        assert set(saved) == names and all(v.dtype == torch.float32 for v in saved.values())
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "exported", torch_dtype=torch.float32)
    for k, v in exported.state_dict().items():
        assert torch.equal(v, saved[f"model.{k}"]), k
    moved = exported.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(moved, initial.model.layers[0].self_attn.q_proj.weight)   # it trained
