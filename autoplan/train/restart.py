"""Where a run starts: the resume policy that makes re-running a launch command safe.

A cluster restarts a crashed job by running its command again. So with a checkpoint directory
the default is ``--resume auto``: resume from the newest checkpoint whose manifest verifies, or
start fresh when there is none -- the first start and every restart are the same command. A run
never overwrites or deletes checkpoints it did not continue from: starting fresh (``--resume
never``) into a directory holding step directories, or resuming an explicit older step while
newer ones exist, is a CheckpointConflictError unless ``--overwrite`` says to delete the newer
ones. Newer directories that fail verification are left where they are (the save of that step
moves them aside, :func:`autoplan.train.checkpoint.save`).

Everything here runs before the model is loaded and is collective: every rank gets the same
answer or the same error.
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import torch.distributed as dist

from autoplan.train import checkpoint, manifest
from autoplan.train.config import TrainConfig
from autoplan.train.errors import CheckpointConflictError, CheckpointError, TrainConfigError

log = logging.getLogger(__name__)
MODES = ("auto", "latest", "never")


def mode(cfg: TrainConfig) -> str:
    """``cfg.resume``, defaulting to ``auto`` with a checkpoint directory and ``never`` without."""
    return cfg.resume or ("auto" if cfg.checkpoint_dir else "never")


def _step_of(path: Path) -> int:
    m = re.match(r"^step-(\d+)$", path.name)
    return int(m.group(1)) if m else int(manifest.read(path)["step"])


def start_point(cfg: TrainConfig, key: bytes | None = None) -> Path | None:
    """The checkpoint this run resumes from (None: start fresh); clears newer step directories
    when ``cfg.overwrite`` allows it, refuses when it does not. ``key``: only checkpoints signed
    with it count (:func:`autoplan.train.checkpoint.latest`). Collective."""
    how, root = mode(cfg), cfg.checkpoint_dir
    existing = checkpoint.step_dirs(root)
    if how == "never":
        chosen = None
    elif how in ("auto", "latest"):
        chosen = checkpoint.latest(root, key)
        if chosen is None and how == "latest":
            raise CheckpointError(f"train: --resume latest: no verified step-N checkpoint under {root} "
                                  f"({len(existing)} step directories); use --resume auto to start fresh "
                                  "when there is none")
        if chosen is None and existing:
            log.warning("train: none of the %d step directories under %s verifies; starting fresh (they are "
                        "kept; a save of the same step moves the old one aside)", len(existing), root)
    else:
        chosen = checkpoint.resolve(how, root, key)
    start = _step_of(chosen) if chosen is not None else 0
    if start > cfg.steps:
        raise TrainConfigError(f"train: the checkpoint {chosen} is at step {start}, beyond --steps {cfg.steps}; "
                               f"raise --steps or use another --checkpoint-dir")
    newer = [p for step, p in existing if step > start and (how not in ("auto", "latest"))]
    if newer:
        _clear(newer, cfg, start)
    return chosen


def _clear(newer: list[Path], cfg: TrainConfig, start: int) -> None:
    names = ", ".join(p.name for p in newer[:5]) + (" ..." if len(newer) > 5 else "")
    if not cfg.overwrite:
        what = "starting fresh" if start == 0 else f"resuming at step {start}"
        raise CheckpointConflictError(
            f"train: --checkpoint-dir {cfg.checkpoint_dir} holds checkpoints beyond step {start} ({names}) that "
            f"{what} would overwrite; resume them with --resume auto, pick another --checkpoint-dir, or add "
            "--overwrite to delete them")
    if not dist.is_initialized() or dist.get_rank() == 0:
        for p in newer:
            shutil.rmtree(p)
        log.warning("train: --overwrite: deleted %d checkpoints beyond step %d under %s (%s)", len(newer), start,
                    cfg.checkpoint_dir, names)
    if dist.is_initialized():
        dist.barrier()
