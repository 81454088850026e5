"""cost_models' exception hierarchy."""


class CostModelError(Exception):
    """Base of every error raised by cost_models."""


class UnknownHardwareError(CostModelError, KeyError):
    """A hardware profile name that has no data file."""


class CalibrationError(CostModelError, RuntimeError):
    """Profiling or collective calibration failed or produced unusable data."""
