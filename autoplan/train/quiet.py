"""Third-party warnings the training driver explains once instead of letting them repeat.

FSDP2 (torch 2.13, ``_fsdp_state._post_forward``) warns on every rank, every run, that the
FSDP-wrapped root "returned a view tensor": an in-place op on that output would drop FSDP's
pre-backward hook. The root's output here is the logits (a view when tensor parallel hands back
a DTensor's local shard, or when an HF model slices its hidden states), and the training step
never modifies them in place -- ``autoplan/plan/forward.py``: ``output_logits`` -> ``lm_loss``
(``cross_entropy``) -> ``/ m``, all out of place; the pipeline schedules' loss the same. So the
warning cannot apply to a training step and is filtered; rank 0 says so once at debug level.
Code that takes the model out of the Trainer and modifies its output in place gets no warning.
"""
from __future__ import annotations

import logging
import warnings

log = logging.getLogger(__name__)
FSDP_VIEW_OUTPUT = r"FSDP2-wrapped module .* returned a view tensor"
_done = False


def quiet_known_warnings(rank: int) -> None:
    """Install the filters (idempotent); each is explained once, on rank 0, at debug level."""
    global _done
    if _done:
        return
    _done = True
    warnings.filterwarnings("ignore", message=FSDP_VIEW_OUTPUT, category=UserWarning)
    if rank == 0:
        log.debug("train: FSDP2's 'returned a view tensor' warning is filtered: the training step uses the "
                  "logits out of place only (autoplan/train/quiet.py)")
