"""`autoplan train` under torchrun on 4 gloo ranks, and checkpoints resumed under other plans.

One torchrun launch (the product contract: train with torchrun; a launch costs tens of seconds on
this 2-core machine): the CLI trains 25 steps under (dp=2, tp=2) saving at steps 20 and 25. The
other runs use the session's 4-rank gloo pool, whose ranks run the same entry points as torchrun's
(``autoplan.cli.main`` and ``Trainer``; see tests/train/train_workers.py): the CLI trains 20 steps
under (pp=2, tp=2); step 20 is resumed under tp=4 and under pp=2 x tp=2; and, in this process as a
plain ``python`` run would (a world of one), on one device, where checkpoints of other models must
be refused. Resumed state must equal the checkpoint read back whole, bit for bit; the next 5 losses
must equal the uninterrupted run's (rtol 1e-5).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autoplan import plan_cluster
from autoplan.train.model import build_model
from tests.train import train_workers

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
LR = "2e-3"
PLANS = {"dp2tp2": (4, dict(dp=2, tp=2, pp=1, fsdp=True), True), "tp4": (4, dict(dp=1, tp=4, pp=1), True),
         "pp2tp2": (4, dict(dp=1, pp=2, tp=2), True), "one": (1, dict(dp=1, tp=1, pp=1), False)}


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def _run(argv, timeout=600) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-5000:])
    return out


def _torchrun(n: int, *args) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *args]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    meta = build_model("titan-llama-debug", device="meta")
    for name, (world, cons, shard_all) in PLANS.items():
        plan = plan_cluster(meta, world, hardware="cpu", batch=(8, 32), devices_per_node=4, constraints=cons,
                            allow_replicated_units=not shard_all, dtype=torch.float32)
        plan = plan.replace(model=dict(plan.model, source="titan-llama-debug"))
        plan.to_json(d / f"{name}.json")
    return d


@pytest.fixture(scope="module")
def run_a(work):
    """The uninterrupted run: 25 steps under (dp=2, tp=2), checkpoint every 20 steps."""
    out = _run(_torchrun(4, "-m", "autoplan.cli", "train", "--plan", str(work / "dp2tp2.json"), "--steps", "25",
                         "--lr", LR, "--checkpoint-dir", str(work / "ckpt"), "--checkpoint-every", "20",
                         "--metrics", str(work / "a.csv"), "--progress", "auto"))
    rows = list(csv.DictReader(open(work / "a.csv")))
    return out, rows


def test_cli_trains_dp_tp_plan_and_checkpoints(run_a, work):
    out, rows = run_a
    assert [int(r["step"]) for r in rows] == list(range(1, 26))
    losses = [float(r["loss"]) for r in rows]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    assert all(float(r["tokens_per_s"]) > 0 and float(r["memory_gib"]) > 0 for r in rows)
    # stdout is a pipe, not a TTY: plain log lines, no escape codes
    assert "step    20 | loss" in out.stderr and "\x1b[" not in out.stdout + out.stderr
    assert sorted(p.name for p in (work / "ckpt").iterdir()) == ["step-20", "step-25"]


def test_cli_trains_pp_tp_plan(work, pool4):
    out = pool4.run(train_workers.cli, ["train", "--plan", str(work / "pp2tp2.json"), "--steps", "20", "--lr", LR,
                                        "--metrics", str(work / "pp.jsonl"), "--progress", "log"])[0]
    assert out["rc"] == 0, out
    rows = [json.loads(line) for line in open(work / "pp.jsonl")]
    losses = [r["loss"] for r in rows]
    assert len(rows) == 20 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    assert "(pipeline " in out["log"] and "trained steps 0..20" in out["stdout"]


def _check_resumed(res: dict, uninterrupted: list[float]):
    assert res["start"] == 20 and res["entries"] > 100
    assert res["differences"] == [], res["differences"]
    assert res["losses"] == pytest.approx(uninterrupted, rel=1e-5)


def test_resume_under_tp4_and_pp2_tp2(run_a, work, pool4):
    _, rows = run_a
    plans = [str(work / "tp4.json"), str(work / "pp2tp2.json")]
    results = pool4.run(train_workers.resume_under, str(work / "ckpt/step-20"), plans, 25, float(LR))[0]
    uninterrupted = [float(r["loss"]) for r in rows[20:25]]
    for plan in plans:
        _check_resumed(results[plan], uninterrupted)


def test_resume_on_one_device_and_mismatched_models(run_a, work, world_of_one):
    _, rows = run_a
    checkpoint, one = str(work / "ckpt/step-20"), str(work / "one.json")
    resumed = train_workers.resume_under(checkpoint, [one], 25, float(LR))[one]
    assert dist.get_world_size() == 1
    _check_resumed(resumed, [float(r["loss"]) for r in rows[20:25]])
    shape, other = train_workers.mismatched_models(checkpoint, one, float(LR))
    assert shape["error"] == other["error"] == "CheckpointMismatchError"
    assert shape["name"] == "layers.0.feed_forward.w1.weight" and "(384, 128)" in shape["message"]
    assert other["name"] == "model.embed_tokens.weight"
    assert shape["untouched"] and other["untouched"] and shape["step_after"] == other["step_after"] == 1


def test_a_tied_head_under_a_v_schedule_trains_as_one_device(tmp_path, pool4, world_of_one):
    """ZBV puts the first and last stage on one rank, so the embedding and its tied LM head are one
    Parameter in two stage modules there and the other rank holds neither: on the large-model path
    (stages on meta until materialised) the tied copies' start-up broadcast once hung the job, and
    the optimizer, given the Parameter twice, stepped it twice (step 2 off by 2.4e-3)."""
    import transformers

    transformers.LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True,
                             max_position_embeddings=128).save_pretrained(tmp_path)
    args = ["train", "--model", str(tmp_path / "config.json"), "--init", "random", "--batch", "8", "--seq", "16",
            "--steps", "3", "--lr", "1e-3", "--mixed-precision", "fp32", "--progress", "none"]

    def losses(out, name):
        assert out["rc"] == 0, out
        return [json.loads(line)["loss"] for line in open(tmp_path / name)]

    four = pool4.run(train_workers.cli, args + ["--constraints", "pp=2,dp=2,tp=1,fsdp=true,schedule=ZBV",
                                                "--metrics", str(tmp_path / "zbv.jsonl")])[0]
    one = train_workers.cli(args + ["--metrics", str(tmp_path / "one.jsonl")])
    assert losses(four, "zbv.jsonl") == pytest.approx(losses(one, "one.jsonl"), rel=1e-5)
