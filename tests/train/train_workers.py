"""Functions run on every rank of a RankPool by the training tests (tests/train/test_train_torchrun.py).

The pool's ranks already hold a gloo process group, so ``autoplan train`` and ``Trainer`` run in
them as under torchrun (``init_distributed`` keeps the existing group): the same train entry
point without paying a process launch and the imports per run. Results are returned from every
rank; the tests read rank 0's (rank 0 is the one that reports).
"""
from __future__ import annotations

import contextlib
import io
import logging

import torch
import torch.distributed as dist

from autoplan.cli import main
from autoplan.train import CheckpointMismatchError, TrainConfig, Trainer
from autoplan.train.checkpoint import consolidated
from autoplan.train.errors import TrainConfigError
from autoplan.train.plan_source import check_ranks_agree, plan_for

HF_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256)


def differences(ref: dict, got: dict) -> list[str]:
    """Keys missing on one side or whose values differ (tensors: dtype, shape and every bit)."""
    out = sorted(set(ref) ^ set(got))
    for k in sorted(set(ref) & set(got)):
        a, b = ref[k], got[k]
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b
        if not same:
            out.append(k)
    return out


def cli(argv: list[str]) -> dict:
    """``autoplan.cli.main(argv)`` on this rank; returns its exit code, stdout and the log lines of
    ``autoplan.train`` (what torchrun's stderr shows), leaving this rank's logging as it was."""
    root, train_log = logging.getLogger(), logging.getLogger("autoplan.train")
    saved = (list(root.handlers), root.level, train_log.level)
    stream, out = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    train_log.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out):
            rc = main(argv)
    finally:
        train_log.removeHandler(handler)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        train_log.setLevel(saved[2])
    return {"rc": rc, "stdout": out.getvalue(), "log": stream.getvalue()}


def resume_under(checkpoint: str, plans: list[str], until: int, lr: float) -> dict:
    """For each plan: load ``checkpoint`` resharded to it, compare every gathered parameter and
    optimizer entry bit for bit with the checkpoint read back whole, then train on to ``until``."""
    base = dict(model="titan-llama-debug", batch=8, seq=32, steps=until, lr=lr, progress="none")
    ref = consolidated(checkpoint)
    results = {}
    for plan in plans:
        tr = Trainer(TrainConfig(plan=plan, resume=checkpoint, **base))
        diffs = differences(ref, tr.gathered_state())
        start = tr.step
        res = tr.fit()
        results[plan] = {"start": start, "entries": len(ref), "differences": diffs[:10], "losses": res.losses}
    return results


def mismatched_models(checkpoint: str, plan: str, lr: float) -> list[dict]:
    """Checkpoints of another model (other ffn width; an HF Llama) must fail with
    CheckpointMismatchError naming the first mismatching parameter and leave model and optimizer
    as they were."""
    base = dict(batch=8, seq=32, steps=1, lr=lr, progress="none", plan=plan)
    rows = []
    for model, model_args in (("titan-llama-debug", {"ffn_hidden": 256}), ("hf:llama", HF_SMALL)):
        # a plan is for one model class (plan.apply refuses another): the HF model plans its own
        own = {} if model.startswith("titan") else {"plan": None, "constraints": {"dp": 1, "tp": 1, "pp": 1}}
        tr = Trainer(TrainConfig(model=model, model_args=model_args, **{**base, **own}))
        tr.fit(1)  # optimizer state exists, so "untouched" covers it too
        before = tr.gathered_state()
        row = {"model": model, "error": None}
        try:
            tr.resume(checkpoint)
        except CheckpointMismatchError as e:
            row.update(error=type(e).__name__, name=e.name, message=str(e))
        row["untouched"] = not differences(before, tr.gathered_state())
        row["step_after"] = tr.step
        rows.append(row)
    return rows


def plan_in_job(cfg_kwargs: dict) -> dict:
    """``plan_for`` on a rank whose process group is up (every rank plans), then the agreement
    check on a plan made to differ by rank: its plan JSON and the check's error."""
    plan = plan_for(TrainConfig(**cfg_kwargs), dist.get_world_size(), torch.device("cpu"))
    plan = plan.replace(model=dict(plan.model, source=f"rank {dist.get_rank()}"))
    try:
        check_ranks_agree(plan)
        error = None
    except TrainConfigError as e:
        error = str(e)
    plan = plan.replace(model=dict(plan.model, source=cfg_kwargs["model"]))
    return {"plan": plan.to_json(), "error": error}


def trainer_with_rank_plans(cfg_kwargs: dict) -> dict:
    """A Trainer given a plan that differs by rank (as ranks that planned before the group was up
    with different host measurements would hold): the error it raises, before any model is built."""
    plan = plan_for(TrainConfig(**cfg_kwargs), dist.get_world_size(), torch.device("cpu"))
    plan = plan.replace(model=dict(plan.model, source=f"rank {dist.get_rank()}"))
    try:
        Trainer(TrainConfig(**cfg_kwargs), plan=plan)
    except TrainConfigError as e:
        return {"error": str(e)}
    return {"error": None}
