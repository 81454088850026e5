"""`autoplan train` under torchrun on 4 gloo ranks, and checkpoints resumed under other plans.

Four launches in all (torchrun is slow on this 2-core machine): the CLI trains 25 steps under
(dp=2, tp=2) saving at step 20, the CLI trains 20 steps under (pp=2, tp=2), one 4-rank worker
resumes step 20 under tp=4 and under pp=2 x tp=2, one single-process worker resumes it on one
device and checks checkpoints of other models. Resumed state must equal the checkpoint read back
whole, bit for bit; the next 5 losses must equal the uninterrupted run's (rtol 1e-5).
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
    from autoplan import plan_cluster
    from autoplan.train.model import build_model

    d = tmp_path_factory.mktemp("train")
    meta = build_model("titan-llama-debug", device="meta")
    for name, (world, cons, shard_all) in PLANS.items():
        plan = plan_cluster(meta, world, hardware="cpu", batch=(8, 32), devices_per_node=4, constraints=cons,
                            allow_replicated_units=not shard_all, dtype=torch.float32)
        plan.model["source"] = "titan-llama-debug"
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


def test_cli_trains_pp_tp_plan(work):
    out = _run(_torchrun(4, "-m", "autoplan.cli", "train", "--plan", str(work / "pp2tp2.json"), "--steps", "20",
                         "--lr", LR, "--metrics", str(work / "pp.jsonl"), "--progress", "log"))
    rows = [json.loads(line) for line in open(work / "pp.jsonl")]
    losses = [r["loss"] for r in rows]
    assert len(rows) == 20 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    assert "(pipeline " in out.stderr and "trained steps 0..20" in out.stdout


def _check_resumed(res: dict, uninterrupted: list[float]):
    assert res["start"] == 20 and res["entries"] > 100
    assert res["differences"] == [], res["differences"]
    assert res["losses"] == pytest.approx(uninterrupted, rel=1e-5)


def test_resume_under_tp4_and_pp2_tp2(run_a, work):
    _, rows = run_a
    _run(_torchrun(4, str(ROOT / "tests/train/resume_worker.py"), "--checkpoint", str(work / "ckpt/step-20"),
                   "--plans", f"{work / 'tp4.json'},{work / 'pp2tp2.json'}", "--lr", LR,
                   "--out", str(work / "r4.json")))
    results = json.loads((work / "r4.json").read_text())["resume"]
    uninterrupted = [float(r["loss"]) for r in rows[20:25]]
    for name in ("tp4", "pp2tp2"):
        _check_resumed(results[name], uninterrupted)


def test_resume_on_one_device_and_mismatched_models(run_a, work):
    _, rows = run_a
    _run([PY, str(ROOT / "tests/train/resume_worker.py"), "--checkpoint", str(work / "ckpt/step-20"),
          "--plans", str(work / "one.json"), "--mismatch-plan", str(work / "one.json"), "--lr", LR,
          "--out", str(work / "r1.json")])
    results = json.loads((work / "r1.json").read_text())
    _check_resumed(results["resume"]["one"], [float(r["loss"]) for r in rows[20:25]])
    shape, other = results["mismatch"]
    assert shape["error"] == other["error"] == "CheckpointMismatchError"
    assert shape["name"] == "layers.0.feed_forward.w1.weight" and "(384, 128)" in shape["message"]
    assert other["name"] == "model.embed_tokens.weight"
    assert shape["untouched"] and other["untouched"] and shape["step_after"] == other["step_after"] == 1
