"""The planner's exception hierarchy; messages name the module, argument or value at fault.

A mesh description is the runtime's (``hyper_parallel.parallel_dims.ParallelDims``), so its errors
are too: ``MeshNameError`` is re-exported here for callers of the planner.
"""
from hyper_parallel.errors import MeshNameError

__all__ = ["AutoplanError", "CaptureError", "InfeasiblePlanError", "InvalidArgumentError", "InvalidConstraintError",
           "MeshNameError", "MissingInputsError", "ModelTooLargeError", "PlanSchemaError", "PlanningError",
           "PretrainedWeightsError", "StrategyCheckError", "UnshardedPlanError"]


class AutoplanError(Exception):
    """Base of every error raised by autoplan."""


class CaptureError(AutoplanError, ValueError):
    """The model could not be captured as a ModelGraph."""


class MissingInputsError(CaptureError):
    """Neither example inputs nor a batch spec were given."""


class ModelTooLargeError(CaptureError):
    """A model on a real device that is too large to copy to meta for capture."""


class PlanningError(AutoplanError):
    """The planner could not produce a plan."""


class InfeasiblePlanError(PlanningError, ValueError):
    """No plan satisfies the constraints (memory limit, divisibility)."""


class UnshardedPlanError(InfeasiblePlanError):
    """A tensor-parallel plan for a model that needs sharding (above a stated size, or with
    replicated units forbidden) would shard nothing or leave a whole model part replicated; the
    message names the construct that stops sharding."""


class StrategyCheckError(PlanningError, RuntimeError):
    """The planner's check of sharded strategies on the model (a fake process group of the
    tensor-parallel degree) cannot run in this process; planning refuses instead of returning a
    plan without the checks. The message says why and where to plan instead."""


class PlanSealedError(AutoplanError, AttributeError):
    """A field of a built Plan was assigned: plans are values once built (``plan.replace(...)``
    makes a changed copy; the planner builds them in ``autoplan.assembler``)."""


class PlanSchemaError(AutoplanError, ValueError):
    """A plan file that is corrupted, truncated, of another schema version or names unknown styles."""


class InvalidArgumentError(AutoplanError, ValueError):
    """An argument of a public entry point with a wrong type or value; the message names the
    argument, the value given and what would be valid."""


class InvalidConstraintError(InvalidArgumentError, InfeasiblePlanError):
    """A plan_cluster constraint that is malformed or that no plan can meet (a pp that does not
    divide the devices, micro-batches that do not divide the batch), refused before the search."""


class PretrainedWeightsError(AutoplanError, ValueError):
    """A pretrained weights directory that cannot be loaded into the model: no weights, an
    unreadable or truncated file, a tensor the model lacks or holds with another shape. Raised
    before any weight is touched; ``name`` is the first tensor at fault (model order),
    ``expected``/``found`` its shapes in the model and in the files, ``file`` the file at fault."""

    def __init__(self, message: str, name: str | None = None, expected=None, found=None, file: str | None = None):
        super().__init__(message)
        self.name, self.expected, self.found, self.file = name, expected, found, file
