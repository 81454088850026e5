"""Errors of the training driver; each names the argument or parameter at fault and what would be valid."""
from __future__ import annotations

from autoplan.errors import AutoplanError


class TrainError(AutoplanError):
    """Base of the training driver's errors."""


class TrainConfigError(TrainError, ValueError):
    """A training setting that cannot work (world size vs plan, batch vs dp, unknown model or data)."""


class DataError(TrainError, ValueError):
    """Token data that cannot be read or is too short for one batch."""


class CheckpointError(TrainError):
    """A checkpoint directory that is missing, incomplete or unreadable."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint of another model or shape: raised before anything is loaded.

    ``name`` is the first mismatching parameter (model order), ``expected``/``found`` its shapes.
    """

    def __init__(self, message: str, name: str, expected=None, found=None):
        super().__init__(message)
        self.name, self.expected, self.found = name, expected, found


class CheckpointCorruptError(CheckpointError):
    """A checkpoint whose files do not match its manifest (or that has none): a flipped byte, a
    truncated or missing shard, garbage metadata. Raised on every rank before anything is loaded.

    ``path`` is the step directory, ``file`` the first bad file in it (None: the directory itself)
    and ``reason`` what is wrong with it."""

    def __init__(self, message: str, path=None, file: str | None = None, reason: str = ""):
        super().__init__(message)
        self.path, self.file, self.reason = path, file, reason


class CheckpointUntrustedError(CheckpointCorruptError):
    """A checkpoint file that is not what such a file must be in a way no disk or crash produces:
    a pickle that would import a function or class outside the allowed data types (loading it would
    run code), metadata pointing outside the checkpoint, or -- with a checkpoint key -- a manifest
    not signed with that key. Raised on every rank before anything is loaded; never skipped in
    favour of an older checkpoint (a tampered checkpoint is reported, not hidden). ``path``,
    ``file``, ``reason``: as for CheckpointCorruptError, ``reason`` naming what was found."""


class CheckpointConflictError(CheckpointError):
    """A run that would overwrite or drop checkpoints it did not write (a fresh start, or a resume
    from an older step, into a directory holding newer ones) without ``--overwrite``."""


class DivergenceError(TrainError):
    """The loss became non-finite or exceeded ``--max-loss``: the run stops at ``step`` before
    saving it, so the last checkpoint stays the last good one."""

    def __init__(self, message: str, step: int, loss: float):
        super().__init__(message)
        self.step, self.loss = step, loss
