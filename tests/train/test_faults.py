"""Training runs that survive what clusters do to them, on the 4-rank gloo pool.

Checkpoints damaged in every way a cluster damages them -- a 16-byte flip at the start, middle
and end of every file, a truncated or missing shard, garbage metadata, a torn train state, a step
directory holding train_state.json alone -- must fail at resume with a CheckpointError naming the
file, on every rank, before anything is loaded; ``latest`` and ``--resume auto`` fall back to the
newest good checkpoint. A finished run's command run again does nothing, ``--resume never`` into
a used directory is refused; a diverging loss stops the run before it saves; clipping reports the
same global gradient norm under every plan; settings that mean nothing are refused up front. The
real-kill rerun and self-restart runs under torchrun are in test_fault_restart.py.
"""
from __future__ import annotations

import csv

import pytest
import torch

from autoplan import plan_cluster
from autoplan.cli import main
from autoplan.train.model import build_model
from tests.train import fault_workers

PLANS = {"dp2tp2": dict(dp=2, tp=2, pp=1, fsdp=True), "tp4": dict(dp=1, tp=4, pp=1), "pp2tp2": dict(dp=1, pp=2, tp=2)}


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("fault-plans")
    meta = build_model("titan-llama-debug", device="meta")
    out = {}
    for name, cons in PLANS.items():
        plan = plan_cluster(meta, 4, hardware="cpu", batch=(8, 32), devices_per_node=4, constraints=cons,
                            allow_replicated_units=False, dtype=torch.float32)
        plan = plan.replace(model=dict(plan.model, source="titan-llama-debug"))
        plan.to_json(d / f"{name}.json")
        out[name] = str(d / f"{name}.json")
    return out


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in _diff(a.get(k), b.get(k), f"{path}/{k}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _same_on_every_rank(results: list) -> dict:
    for rank, r in enumerate(results[1:], 1):
        assert not _diff(results[0], r), (rank, _diff(results[0], r)[:3])
    return results[0]


def test_damaged_checkpoints_fail_typed_and_latest_falls_back(plans, pool4, tmp_path):
    res = _same_on_every_rank(pool4.run(fault_workers.corruption, str(tmp_path), plans["dp2tp2"]))
    kinds = {"__0_0.distcp", "__3_0.distcp", ".metadata", "rng.pt", "train_state.json", "manifest.json"}
    assert kinds <= set(res["files"])
    assert len(res["flips"]) == 3 * len(res["files"])
    for where, got in res["flips"].items():
        assert got["resume"]["error"] == "CheckpointCorruptError", (where, got)
        assert got["resume"]["file"] == where.split("@")[0], (where, got)
        assert "step-4" in got["resume"]["message"]
        assert got["latest"].endswith("step-2"), (where, got)
    expect = {"truncated shard": "__1_0.distcp", "missing shard": "__1_0.distcp", "garbage metadata": ".metadata",
              "truncated train state": "train_state.json", "no manifest": "manifest.json",
              "metadata behind the manifest": ".metadata", "train state alone": "manifest.json"}
    for case, file in expect.items():
        got = res["cases"][case]
        assert got["resume"]["error"] == "CheckpointCorruptError" and got["resume"]["file"] == file, (case, got)
    behind = res["cases"]["truncated shard behind the manifest"]["resume"]
    assert behind["error"] == "CheckpointCorruptError" and "distcp" in behind["file"], behind
    assert res["cases"]["train state alone"]["latest"].endswith("step-4")
    assert res["untouched"] and res["step"] == 4   # every failure came before anything was loaded
    # --resume auto with step-4 damaged (and step-9 incomplete): resumes at step 2, redoes 3 and 4
    assert res["auto_start"] == 2
    assert res["auto_losses"][:2] == pytest.approx(res["losses"][2:4], rel=1e-5)
    assert res["after_auto"] == ["step-2", "step-4", "step-4.replaced-1", "step-5", "step-9"]


def test_rerunning_a_finished_run_and_starting_fresh_over_one(plans, pool4, tmp_path):
    res = pool4.run(fault_workers.rerun_semantics, str(tmp_path), plans["dp2tp2"])
    assert [r["rc"] for r in res] == [[0, 0, 2, 0]] * 4   # every rank: the same outcome
    res = res[0]
    assert "nothing to train" in res["again"]
    assert res["kept"] == ["step-2", "step-4"]   # --resume never refused, nothing deleted
    assert "trained steps 0..1" in res["over_stdout"] and "--overwrite: deleted 2" in res["over_log"]
    assert res["dirs"] == ["step-1"]
    rows = list(csv.DictReader(open(tmp_path / "m.csv")))
    assert [int(r["step"]) for r in rows] == [1]


def test_diverging_loss_stops_before_saving(plans, pool4, tmp_path):
    res = _same_on_every_rank(pool4.run(fault_workers.divergence, str(tmp_path), plans["dp2tp2"]))
    assert res["error"] == "DivergenceError" and res["step"] == 4 and "step 4" in res["message"], res
    assert res["dirs"] == ["step-1", "step-2", "step-3"]
    assert res["resumed_at"] == 3 and len(res["resumed_losses"]) == 2
    assert all(l == l and l < 10 for l in res["resumed_losses"])
    assert res["max_loss_step"] == 1


def test_clip_grad_norm_is_the_global_norm_under_every_plan(plans, pool4):
    names = ["dp2tp2", "tp4", "pp2tp2"]
    res = pool4.run(fault_workers.clipping, [plans[n] for n in names])[0]
    norms = [res[plans[n]]["norms"] for n in names]
    assert norms[0][0] > 0.5   # so clipping at 0.5 changes the update
    for other in norms[1:]:
        assert other == pytest.approx(norms[0], rel=1e-4)
    clipped = res[plans["dp2tp2"]]["losses"]
    assert clipped[0] == pytest.approx(res["unclipped_losses"][0], rel=1e-6)
    assert abs(clipped[1] - res["unclipped_losses"][1]) > 1e-6


@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps"), (["--batch", "0"], "--batch"), (["--lr", "0"], "--lr"),
    (["--checkpoint-every", "5"], "--checkpoint-every"), (["--resume", "latest"], "--resume"),
    (["--max-loss", "-1"], "--max-loss"), (["--clip-grad-norm", "nan"], "--clip-grad-norm"),
    (["--overwrite"], "--overwrite"), (["--log-every", "0"], "--log-every"),
    (["--checkpoint-key", "key.txt"], "--checkpoint-key")])
def test_meaningless_settings_are_rejected_before_any_work(argv, flag, capsys):
    assert main(["train", "--model", "titan-llama-debug", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TrainConfigError" in err[0] and flag in err[0], err


def test_cli_wraps_base_exception_errors(monkeypatch, capsys):
    from torch.distributed.checkpoint.api import CheckpointException

    import autoplan.train.cli as train_cli

    def boom(cfg):
        raise CheckpointException("load", {0: (RuntimeError("shard unreadable"), None)})

    monkeypatch.setattr(train_cli, "train", boom)
    assert main(["train", "--model", "titan-llama-debug", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["autoplan train: error: CheckpointException: rank 0: RuntimeError: shard unreadable"], err


def test_planning_probe_failures_become_a_note_not_tracebacks(capsys):
    """torch logs each failed fake-tensor probe as an ERROR with a traceback; while planning they
    are counted into the plan's notes instead (plan_source._ProbeFailures)."""
    import logging

    from autoplan.train.plan_source import _ProbeFailures

    fake_log, probes = logging.getLogger("torch._subclasses.fake_tensor"), _ProbeFailures()
    fake_log.addFilter(probes)
    try:
        try:
            raise RuntimeError("Attempting to broadcast a dimension of length 16 at -1!")
        except RuntimeError:
            fake_log.exception("failed while attempting to run meta for %s", "aten.mul.Tensor")
    finally:
        fake_log.removeFilter(probes)
    assert probes.count == 1 and "aten.mul.Tensor: RuntimeError: Attempting to broadcast" in probes.first
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
