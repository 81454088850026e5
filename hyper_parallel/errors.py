"""The runtime's exception hierarchy.

Every error names the module, argument or value at fault, so a user can fix the plan without
reading our code. They subclass ValueError/TypeError where that is the natural category, so
generic ``except ValueError`` handlers keep working.
"""


class HyperParallelError(Exception):
    """Base of every error raised by hyper_parallel."""


class MeshError(HyperParallelError, ValueError):
    """A device mesh of the wrong rank, size or dimension name."""


class PlanPatternError(HyperParallelError, ValueError):
    """A parallelize plan whose key matches no module, or whose value is not a style."""


class PlanTypeError(PlanPatternError, TypeError):
    """A plan that is neither a ParallelStyle nor a dict of them (torch raises TypeError here)."""


class UnsupportedModuleError(HyperParallelError, TypeError):
    """A parallel style applied to a module type it does not know how to shard."""


class LayoutError(HyperParallelError, ValueError):
    """Inputs or outputs that do not match the layouts a style was given."""


class DivisibilityError(HyperParallelError, ValueError):
    """A tensor dimension that the mesh dimension does not divide."""


class StyleSpecError(HyperParallelError, ValueError):
    """A serialized style (dict) that names an unknown style or carries bad arguments."""


class PipelineError(HyperParallelError):
    """Base of pipeline-parallel errors."""


class ScheduleError(PipelineError, ValueError):
    """A pipeline schedule that is invalid: unmatched send/recv, deadlock, bad micro-batch count."""


class UnknownScheduleError(ScheduleError):
    """A schedule name that is not in the runtime's table (``schedule_facts.SCHEDULES``); plans,
    the planner and the cost model all name schedules by that table, so one typo fails here."""


class MicrobatchError(PipelineError, ValueError):
    """A batch that cannot be split into the requested micro-batches."""


class DistributedRunError(HyperParallelError, RuntimeError):
    """A multi-rank run that failed or timed out on one or more ranks."""


class StageSplitError(PipelineError, ValueError):
    """Cut points that do not name a stage boundary of the model, or a model the split cannot read."""


class AlreadyParallelizedError(HyperParallelError, ValueError):
    """A module that a parallelize call (ours or torch's) has already sharded or hooked; applying a
    second style on top would compose layouts nobody asked for and fail later in forward."""


class MeshNameError(MeshError):
    """A mesh dimension name that does not say which parallelism it carries, or two names for one."""


class InitError(HyperParallelError, ValueError):
    """A meta-built model whose tensors cannot be given initial values: a module with tensors and
    no init function, a tensor the init function left unset, or a name the model does not have."""


class InvalidWorldError(HyperParallelError, ValueError):
    """A fake world's size or rank that is not an int in range."""


class WorldIsolationError(DistributedRunError):
    """A fake world (planning's strategy probe, a dry run) that cannot be isolated from the
    process's own process groups; the message says why and what to do instead (plan before
    ``init_process_group`` or in a separate process, or pass a plan file)."""


class PipelinePeerFailedError(PipelineError):
    """Another rank of the pipeline group failed inside the same step; raised on every waiting rank
    within seconds instead of at the process group's timeout. ``failed_rank``: its global rank."""

    def __init__(self, failed_rank: int, reason: str, rank: int):
        super().__init__(f"pipeline rank {rank}: global rank {failed_rank} failed inside this step "
                         f"({reason}); this rank stopped waiting for it")
        self.failed_rank, self.reason, self.rank = failed_rank, reason, rank

    def __reduce__(self):   # rebuilt from its fields when it crosses processes (RankPool results)
        return type(self), (self.failed_rank, self.reason, self.rank)


class CompileError(HyperParallelError, ValueError):
    """A compile setting that is not valid (unknown mode or backend), or a part of a parallelized
    model that cannot run under ``torch.compile`` -- refused by name instead of run differently."""


class AsyncTPError(CompileError):
    """Async tensor parallelism asked for where it cannot run: it needs ``torch.compile`` with
    inductor (whose micro-pipeline pass does the fusing), CUDA devices and a backend with
    symmetric memory (NCCL). The plan can still be priced; it cannot be applied so here."""
