"""A rank killed mid-run, under torchrun on 4 gloo ranks: the same command run again resumes, and
a job started with ``--max-restarts`` restarts itself -- both ending with the uninterrupted run's
losses, every metrics row once, every checkpoint verified.

Two launches (a launch costs ~20 s here): the first is killed before step 5 (rank 1 SIGKILLs
itself, tests/train/fault_entry.py) with no restarts, so the job fails; the second is the same
``autoplan train`` command under ``torchrun --max-restarts 1`` -- it resumes from step-3, is
killed again before step 8, and torchrun's next attempt resumes from step-6 and finishes step 10.
The uninterrupted reference runs on the session's 4-rank pool (the same entry point; the
existing torchrun-vs-pool tests hold its losses equal at rtol 1e-5). Restarting under gloo needs
the per-attempt store prefix of ``autoplan.train.env`` (torchrun's agent store keeps the dead
attempt's gloo addresses).
"""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.train import manifest
from tests.train.test_faults import plans  # noqa: F401 - the module's plan files fixture
from tests.train.train_workers import cli

ROOT = Path(__file__).resolve().parents[2]


def _launch(max_restarts: int, args: list[str], marker: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", FAULT_KILL_STEP="5,8",
               FAULT_KILL_MARKER=str(marker))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "--max-restarts", str(max_restarts), "-m", "tests.train.fault_entry", *args]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


def test_killed_rank_rerun_and_self_restart(plans, pool4, tmp_path):  # noqa: F811
    def train_args(d: Path) -> list[str]:
        return ["train", "--plan", plans["dp2tp2"], "--steps", "10", "--lr", "2e-3", "--checkpoint-dir",
                str(d / "ckpt"), "--checkpoint-every", "3", "--metrics", str(d / "metrics.csv"), "--progress", "log"]

    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    assert pool4.run(cli, train_args(ref_dir))[0]["rc"] == 0
    ref = [float(r["loss"]) for r in csv.DictReader(open(ref_dir / "metrics.csv"))]

    marker = tmp_path / "killed"
    first = _launch(0, train_args(run_dir), marker)
    assert first.returncode != 0 and Path(f"{marker}.5").exists(), first.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == ["step-3"]

    second = _launch(1, train_args(run_dir), marker)   # the same train command; torchrun may restart it once
    assert second.returncode == 0, second.stderr[-5000:]
    assert Path(f"{marker}.8").exists()
    log = second.stderr
    assert "resumed from" in log and "step-3" in log and "step-6 (step 6, verified)" in log, log[-5000:]

    rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    assert [int(r["step"]) for r in rows] == list(range(1, 11))   # none lost, none twice
    assert [float(r["loss"]) for r in rows] == pytest.approx(ref, rel=1e-5)
    dirs = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    assert dirs == ["step-10", "step-3", "step-6", "step-9"]
    for d in dirs:
        manifest.verify(run_dir / "ckpt" / d, collective=False)
