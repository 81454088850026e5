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
