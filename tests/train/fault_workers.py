"""Functions run on every rank of the 4-rank gloo pool by tests/train/test_faults.py.

Each returns this rank's observations (error type, named file, step reached ...), so the test can
check that every rank saw the same typed error -- a rank that saw another, or none, would have
hung the others in a real job. Files are damaged by rank 0 between barriers.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.train import TrainConfig, Trainer
from autoplan.train import checkpoint, manifest
from autoplan.train.errors import CheckpointError, DivergenceError
from tests.train.train_workers import cli, differences

BASE = dict(model="titan-llama-debug", batch=8, seq=32, lr=2e-3, progress="none")


def _on_rank0(fn) -> None:
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def _flip(path: Path, offset: int, n: int = 16) -> bytes:
    """XOR ``n`` bytes at ``offset`` (clamped into the file) with 0xFF; returns the original bytes."""
    data = bytearray(path.read_bytes())
    offset = max(0, min(offset, len(data) - n))
    old = bytes(data[offset:offset + n])
    data[offset:offset + n] = bytes(b ^ 0xFF for b in old)
    path.write_bytes(bytes(data))
    return old


def _restore(path: Path, offset: int, old: bytes) -> None:
    data = bytearray(path.read_bytes())
    offset = max(0, min(offset, len(data) - len(old)))
    data[offset:offset + len(old)] = old
    path.write_bytes(bytes(data))


def _outcome(fn) -> dict:
    try:
        out = fn()
        return {"error": None, "value": str(out) if out is not None else None}
    except CheckpointError as e:
        return {"error": type(e).__name__, "file": getattr(e, "file", None), "message": str(e)}


def corruption(root: str, plan: str) -> dict:
    """Save step-2 and step-4, then damage step-4 in every way the issue lists; each must fail at
    resume with a CheckpointError naming the file, leave the model untouched, and ``latest`` must
    fall back to step-2."""
    root_p = Path(root)
    tr = Trainer(TrainConfig(plan=plan, steps=4, checkpoint_dir=root, checkpoint_every=2, **BASE))
    first = tr.fit()
    ck = root_p / "step-4"
    files = sorted(manifest.read(ck)["files"]) + [manifest.MANIFEST]
    before = tr.gathered_state()
    out: dict = {"files": files, "flips": {}, "cases": {}, "losses": first.losses}

    def resume_and_latest():
        return {"resume": _outcome(lambda: tr.resume(ck)), "latest": str(checkpoint.latest(root_p))}

    # a 16-byte flip at the start, the middle and the end of every file kind
    sizes = {name: (ck / name).stat().st_size for name in files}   # before any damage, the same on every rank
    dist.barrier()
    for name in files:
        size = sizes[name]
        for where in (0, size // 2, size):
            box = {}
            _on_rank0(lambda: box.update(old=_flip(ck / name, where)))
            out["flips"][f"{name}@{where}"] = resume_and_latest()
            _on_rank0(lambda: _restore(ck / name, where, box["old"]))

    def damaged(case: str, damage, repair):
        _on_rank0(damage)
        out["cases"][case] = resume_and_latest()
        _on_rank0(repair)

    shard = ck / "__1_0.distcp"
    saved = {p.name: p.read_bytes() for p in ck.iterdir()}
    put_back = lambda *names: [(ck / n).write_bytes(saved[n]) for n in names]  # noqa: E731
    damaged("truncated shard", lambda: shard.write_bytes(saved[shard.name][:1000]), lambda: put_back(shard.name))
    damaged("missing shard", lambda: shard.unlink(), lambda: put_back(shard.name))
    damaged("garbage metadata", lambda: (ck / ".metadata").write_bytes(b"garbage" * 10), lambda: put_back(".metadata"))
    damaged("truncated train state", lambda: (ck / "train_state.json").write_text('{"step": 4, "da'),
            lambda: put_back("train_state.json"))
    damaged("no manifest", lambda: (ck / "manifest.json").unlink(), lambda: put_back("manifest.json"))

    # behind the manifest: damage it cannot see (the manifest rewritten to match), so torch's own
    # errors -- DCP's CheckpointException (a BaseException), UnpicklingError -- must come out typed
    def rehash():
        body = manifest.read(ck)
        manifest.write(ck, manifest.entries(ck, list(body["files"])),
                       **{k: v for k, v in body.items() if k not in ("files", "format", "hash")})

    damaged("metadata behind the manifest", lambda: ((ck / ".metadata").write_bytes(b"garbage" * 10), rehash()),
            lambda: (put_back(".metadata", "manifest.json")))
    damaged("truncated shard behind the manifest", lambda: (shard.write_bytes(saved[shard.name][:1000]), rehash()),
            lambda: (put_back(shard.name, "manifest.json")))

    # case 7: a step directory holding train_state.json alone is not a checkpoint
    lone = root_p / "step-9"
    _on_rank0(lambda: (lone.mkdir(), (lone / "train_state.json").write_text('{"step": 9}\n')))
    out["cases"]["train state alone"] = {"resume": _outcome(lambda: tr.resume(lone)),
                                         "latest": str(checkpoint.latest(root_p))}
    out["untouched"] = not differences(before, tr.gathered_state())
    out["step"] = tr.step

    # --resume auto with a bad newest checkpoint: resumes from the newest good one, warns
    _on_rank0(lambda: _flip(ck / "__0_0.distcp", 100))
    auto = Trainer(TrainConfig(plan=plan, steps=5, checkpoint_dir=root, checkpoint_every=2, **BASE))
    out["auto_start"] = auto.step
    res = auto.fit()
    out["auto_losses"] = res.losses
    out["after_auto"] = sorted(p.name for p in root_p.iterdir())
    return out


def rerun_semantics(root: str, plan: str) -> dict:
    """The same ``autoplan train`` command run again on a finished run does nothing and touches
    nothing; ``--resume never`` into its directory is refused; with ``--overwrite`` it starts
    fresh and deletes the newer checkpoints. (A crashed run's rerun: test_fault_restart.py.)"""
    argv = ["train", "--plan", plan, "--steps", "4", "--lr", "2e-3", "--checkpoint-dir", f"{root}/ckpt",
            "--checkpoint-every", "2", "--metrics", f"{root}/m.csv", "--progress", "none"]
    done = cli(argv)
    again = cli(argv)
    never = cli(argv + ["--resume", "never"])
    dirs_after_never = sorted(p.name for p in Path(root, "ckpt").iterdir())
    over = cli(argv[:4] + ["1"] + argv[5:] + ["--resume", "never", "--overwrite"])
    return {"rc": [done["rc"], again["rc"], never["rc"], over["rc"]], "again": again["stdout"],
            "kept": dirs_after_never, "over_log": over["log"], "over_stdout": over["stdout"],
            "dirs": sorted(p.name for p in Path(root, "ckpt").iterdir())}


def divergence(root: str, plan: str) -> dict:
    """NaN weights before step 4 (checkpoint every step): DivergenceError at step 4 on every rank,
    no step-4 directory, and step-3 verifies and loads; then --max-loss trips at step 1."""
    tr = Trainer(TrainConfig(plan=plan, steps=6, checkpoint_dir=root, checkpoint_every=1, **BASE))
    tr.fit(3)
    with torch.no_grad():
        for p in tr.model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).fill_(math.nan)
    out: dict = {}
    try:
        tr.fit()
    except DivergenceError as e:
        out.update(error=type(e).__name__, step=e.step, message=str(e))
    out["dirs"] = sorted(p.name for p in Path(root).iterdir())
    again = Trainer(TrainConfig(plan=plan, steps=5, checkpoint_dir=root, **BASE))
    out["resumed_at"] = again.step
    out["resumed_losses"] = again.fit().losses
    try:
        Trainer(TrainConfig(plan=plan, steps=3, max_loss=1.0, **BASE)).fit()
    except DivergenceError as e:
        out["max_loss_step"] = e.step
    return out


def clipping(plans: list[str]) -> dict:
    """--clip-grad-norm under each plan: the norm reported before clipping must be the same global
    norm whatever the sharding (FSDP x TP shards, TP shards, pipeline stages)."""
    out = {}
    for plan in plans:
        res = Trainer(TrainConfig(plan=plan, steps=2, clip_grad_norm=0.5, **BASE)).fit()
        out[plan] = {"norms": [r["grad_norm"] for r in res.rows], "losses": res.losses}
    unclipped = Trainer(TrainConfig(plan=plans[0], steps=2, **BASE)).fit()
    out["unclipped_losses"] = unclipped.losses
    return out
