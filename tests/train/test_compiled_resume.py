"""`autoplan train --compile blocks` trains, checkpoints and resumes across compiled and eager runs
bit for bit: compiling in place keeps the module objects and state-dict keys, and ``aot_eager``
runs eager's own kernels, so a compiled run's losses equal the eager run's exactly and a checkpoint
written by one resumes in the other (4 gloo ranks, dp=2 x tp=2 FSDP)."""
from __future__ import annotations

import json

import pytest
import torch

from autoplan import plan_cluster
from autoplan.train.model import build_model
from tests.train import train_workers

COMPILED = ["--compile", "blocks", "--compile-backend", "aot_eager"]
EAGER = ["--compile", "none"]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("compiled_resume")
    meta = build_model("titan-llama-debug", device="meta")
    plan = plan_cluster(meta, 4, hardware="cpu", batch=(8, 32), devices_per_node=4,
                        constraints=dict(dp=2, tp=2, pp=1, fsdp=True), allow_replicated_units=False,
                        dtype=torch.float32)
    plan.replace(model=dict(plan.model, source="titan-llama-debug")).to_json(d / "plan.json")
    return d


def _train(pool4, d, name: str, mode: list[str], steps: int, resume: str | None = None) -> list[float]:
    ckpt = d / f"ckpt-{name}"
    argv = ["train", "--plan", str(d / "plan.json"), "--steps", str(steps), "--lr", "2e-3", *mode,
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--metrics", str(d / f"{name}.jsonl"),
            "--progress", "log"]
    if resume:
        argv += ["--resume", resume]
    out = pool4.run(train_workers.cli, argv)[0]
    assert out["rc"] == 0, out
    return [json.loads(line)["loss"] for line in open(d / f"{name}.jsonl")]


@pytest.mark.timeout(1200)
def test_compiled_and_eager_runs_resume_each_other_bit_for_bit(plan_file, pool4):
    d = plan_file
    compiled = _train(pool4, d, "compiled", COMPILED, 4)
    eager = _train(pool4, d, "eager", EAGER, 4)
    assert compiled == eager   # exactly: aot_eager runs eager's kernels on the same graph
    # a compiled run's checkpoint resumed eager, and an eager one resumed compiled
    assert _train(pool4, d, "c2e", EAGER, 4, resume=str(d / "ckpt-compiled" / "step-2")) == compiled[2:]
    assert _train(pool4, d, "e2c", COMPILED, 4, resume=str(d / "ckpt-eager" / "step-2")) == eager[2:]
