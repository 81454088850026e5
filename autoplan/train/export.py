"""``autoplan export-hf``: a training checkpoint (a ``step-N`` directory) as a Hugging Face directory.

The checkpoint records the model it trained (``train_state.json``'s settings: ``--model``,
``--layers``, the config overrides), so the model is rebuilt on meta from them, its tensors read
from the checkpoint's ``model.*`` entries with DCP in this one process (no process group: every
tensor whole, resharded from whatever plan wrote them), and written by ``save_pretrained`` with
the model's config. The checkpoint is opened as a resume opens it (manifest verified, every file
data: :func:`autoplan.train.safe_load.open_checkpoint`), so a checkpoint from elsewhere runs no code.
The whole model is held once in this process's memory; a running job exports
without that (``autoplan train --export-hf``, every rank writing its slices).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from autoplan.errors import InvalidArgumentError
from autoplan.train.checkpoint import TRAIN_STATE
from autoplan.train.errors import CheckpointError, CheckpointMismatchError
from autoplan.train.safe_load import open_checkpoint
from autoplan.train.model import build_model

log = logging.getLogger(__name__)


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, dtype: torch.dtype | None = None,
                      key: bytes | None = None) -> Path:
    """Write the model of ``checkpoint`` as a ``from_pretrained`` directory at ``out``; ``key``:
    refuse a checkpoint not signed with it."""
    checkpoint, out = Path(checkpoint), Path(out)
    opened = open_checkpoint(checkpoint, key=key, collective=False)
    state_file = checkpoint / TRAIN_STATE
    try:
        settings = json.loads(state_file.read_text())["config"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"export-hf: {state_file} is missing or unreadable ({type(e).__name__}: {e}); give a "
                              "step-N directory written by autoplan train") from None
    if out.exists() and any(out.iterdir()):
        raise InvalidArgumentError(f"export-hf: --out {str(out)!r} exists and is not empty; give a new directory")
    model = build_model(settings["model"], layers=settings.get("layers"), overrides=settings.get("model_args") or {},
                        device="meta")
    if not hasattr(getattr(model, "config", None), "save_pretrained"):
        raise InvalidArgumentError(f"export-hf: the checkpoint's model {settings['model']!r} is not a transformers "
                                   "model; only those can be written as a from_pretrained directory")
    model = model.to_empty(device="cpu")
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    try:
        opened.load(state, no_dist=True)
    except BaseException as e:  # DCP's CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit, CheckpointError)):
            raise
        raise CheckpointMismatchError(f"export-hf: {checkpoint} does not hold the model its settings name "
                                      f"({type(e).__name__}: {str(e).strip()[:300]})", name="") from None
    model.load_state_dict({k[len("model."):]: v for k, v in state.items()})
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(out))
    log.info("exported %s -> %s", checkpoint, out)
    return out
