"""Distributed checkpoints with torch DCP that load under another plan.

Parameters and AdamW state are saved by fully-qualified name of the *original* model
(``get_state_dict`` with a flattened optimizer state: ``state.<fqn>.exp_avg``), each a DTensor
with its global shape; DCP reshards on load, so a checkpoint written under (dp=2, tp=2) loads
under tp=4, under pp=2 x tp=2 or on one device. Pipeline stages keep the original FQNs
(hyper_parallel's ``split_model`` registers each unit under its original path); a rank with
several stages is presented to DCP as one module holding all its units (:func:`state_module`).

A step directory holds the DCP files plus ``train_state.json`` (step, data position, settings)
and ``rng.pt``; it is written under ``<name>.tmp`` and renamed when complete, so a crash mid-save
never leaves a directory that looks loadable. Before anything is loaded every parameter name and
global shape is checked against the checkpoint's metadata on every rank, so a checkpoint of
another model fails with :class:`CheckpointMismatchError` naming the first mismatching
parameter and leaves the model and optimizer untouched.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from autoplan.plan.held import held_module as state_module
from autoplan.train.errors import CheckpointError, CheckpointMismatchError

log = logging.getLogger(__name__)
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_STEP_DIR = re.compile(r"^step-(\d+)$")
TRAIN_STATE = "train_state.json"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step}"


def latest(root: str | Path) -> Path | None:
    """The highest complete ``step-N`` directory under ``root`` (None when there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / TRAIN_STATE).is_file()]
    return max(found)[1] if found else None


def resolve(resume: str, root: str | Path | None) -> Path:
    """``resume``: ``latest`` (under ``root``) or a step directory."""
    if resume == "latest":
        if root is None:
            raise CheckpointError("train: --resume latest needs --checkpoint-dir")
        path = latest(root)
        if path is None:
            raise CheckpointError(f"train: --resume latest: no complete step-N checkpoint under {root}")
        return path
    path = Path(resume)
    if not (path / TRAIN_STATE).is_file():
        raise CheckpointError(f"train: --resume {resume!r}: not a complete checkpoint directory "
                              f"(no {TRAIN_STATE}); give a step-N directory or 'latest'")
    return path


def save(runner, root: str | Path, step: int, train_state: dict[str, Any]) -> Path:
    """Write this step's checkpoint (collective: every rank calls it)."""
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    msd, osd = get_state_dict(state_module(runner), runner.optimizer, options=OPTIONS)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
    if rank == 0:
        torch.save({"cpu": torch.get_rng_state()}, tmp / "rng.pt")
        (tmp / TRAIN_STATE).write_text(json.dumps(dict(train_state, step=step), indent=1, sort_keys=True) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()
    log.debug("checkpoint step %d -> %s", step, final)
    return final


def _global_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)  # a DTensor's shape is its global shape


def check_compatible(model: nn.Module, path: str | Path) -> None:
    """Raise CheckpointMismatchError for the first parameter (model order) that the checkpoint at
    ``path`` lacks or holds with another global shape, or the first checkpoint parameter the model
    lacks. ``model`` is the whole model (every stage), so every rank reaches the same verdict."""
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: v for k, v in meta.items() if k.startswith("model.")}
    mine = dict(model.state_dict(keep_vars=True).items())
    for name, t in mine.items():
        if name not in saved:
            near = [k for k in saved if k.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]][:3]
            raise CheckpointMismatchError(
                f"checkpoint {path}: parameter {name!r} of the model is not in the checkpoint "
                f"(it holds {len(saved)} tensors, e.g. {near or list(saved)[:3]}); is it a checkpoint of "
                "another model?", name, _global_shape(t), None)
        md = saved[name]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != _global_shape(t):
            found = tuple(md.size) if isinstance(md, TensorStorageMetadata) else type(md).__name__
            raise CheckpointMismatchError(
                f"checkpoint {path}: parameter {name!r} has shape {found} in the checkpoint, "
                f"{_global_shape(t)} in the model", name, _global_shape(t), found)
    extra = [k for k in saved if k not in mine]
    if extra:
        raise CheckpointMismatchError(
            f"checkpoint {path}: parameter {extra[0]!r} of the checkpoint is not in the model "
            f"({len(extra)} such); is it a checkpoint of another model?", extra[0], None,
            tuple(saved[extra[0]].size) if isinstance(saved[extra[0]], TensorStorageMetadata) else None)


def load(runner, model: nn.Module, path: str | Path) -> dict[str, Any]:
    """Load parameters, optimizer state and RNG from ``path`` into this rank's share, resharded
    to the current plan; returns the saved train state (step, data position, ...)."""
    path = Path(path)
    check_compatible(model, path)
    module = state_module(runner)
    msd, osd = get_state_dict(module, runner.optimizer, options=OPTIONS)
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [k for k in osd if f"optim.{k}" not in meta]
    if missing:
        raise CheckpointMismatchError(
            f"checkpoint {path}: optimizer entry {missing[0]!r} is not in the checkpoint ({len(missing)} "
            "missing); was it written with another optimizer?", missing[0])
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(module, runner.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=OPTIONS)
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["cpu"])
    log.info("resumed from %s", path)
    return json.loads((path / TRAIN_STATE).read_text())


def gathered_state(runner) -> dict[str, Any]:
    """Every parameter and optimizer entry of the whole model as full CPU tensors, keyed like the
    checkpoint (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, ...); collective, the same dict on
    every rank. For checks and small models: it holds the whole model on each rank."""
    msd, osd = get_state_dict(state_module(runner), runner.optimizer, options=OPTIONS)
    local = {}
    for prefix, sd in (("model", msd), ("optim", osd)):
        for k, v in sd.items():
            if isinstance(v, DTensor):
                v = v.full_tensor()
            local[f"{prefix}.{k}"] = v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    out: dict[str, Any] = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return dict(sorted(out.items()))


def consolidated(path: str | Path) -> dict[str, Any]:
    """A checkpoint read back whole in this process (no process group): ``{"model.<fqn>": tensor,
    "optim.state.<fqn>.exp_avg": tensor, ...}`` exactly as saved, keyed like :func:`gathered_state`.
    For exporting a one-file copy and for checking what a resharded load produced."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(path), str(out))
        nested = torch.load(out, weights_only=False)
    flat = {f"{top}.{k}": v for top, sd in nested.items() for k, v in sd.items()}
    return dict(sorted(flat.items()))
