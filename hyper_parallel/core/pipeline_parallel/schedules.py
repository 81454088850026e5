"""The runtime schedules: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZeroBubble,
ScheduleZBV. Each builds its IR with a generator, validates it before any communication, and
runs it with the executor; ``Schedule*.ir(n_ranks, n_microbatches)`` gives the planner the very
same IR without torch state.
"""
from __future__ import annotations

import logging
import zlib
from typing import Callable, ContextManager, Mapping, Sequence

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from hyper_parallel.core.pipeline_parallel import generators
from hyper_parallel.core.pipeline_parallel.executor import StepState, run_program
from hyper_parallel.core.pipeline_parallel.failfast import StepFailure
from hyper_parallel.core.pipeline_parallel.fsdp_actions import fsdp_hooks, has_fsdp, prepare_fsdp_backward
from hyper_parallel.core.pipeline_parallel.microbatch import BatchDimSpec, split_microbatches
from hyper_parallel.core.pipeline_parallel.mpipe import Preprocess, PreprocessState
from hyper_parallel.core.pipeline_parallel.mpipe_ir import mpipe
from hyper_parallel.core.pipeline_parallel.schedule_ir import PipelineSchedule, lower
from hyper_parallel.core.pipeline_parallel.shape_inference import infer_boundaries, signature
from hyper_parallel.core.pipeline_parallel.shared_params import SharedParameters
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage, flatten
from hyper_parallel.core.pipeline_parallel.validator import validate_schedule
from hyper_parallel.errors import MicrobatchError, PipelineError, PipelinePeerFailedError, ScheduleError

log = logging.getLogger(__name__)
# bytes of the per-step agreement all-reduce: the input signature, then (value, -value) for the
# micro-batch count, the stage count and the schedule hash (int64 each); the planner predicts it
AGREEMENT_BYTES = 8 * 7


class PipelineScheduleRuntime:
    """Runs a schedule IR over this rank's stages.

    ``stages``: this rank's PipelineStage(s). ``loss_fn(output, target)`` runs on the last stage
    per micro-batch; gradients are those of the mean of the micro-batch losses (``scale_grads``).
    ``shared_parameters``: tied groups ({stage: FQN}); by default read from stage modules built
    by :func:`split_model`. ``schedule``: a ready IR instead of the class's generator.
    ``fifo``: also check that each peer receives in send order (default: on every backend but
    gloo, whose tags match messages in any order). ``dp_group``: with data parallel, shared parameters must be left out of FSDP
    (``ignored_params``); their gradients are then averaged over this group after the step.
    ``loss_context``: a context-manager factory entered around the loss and around the last
    stage's backward (e.g. ``loss_parallel`` for vocabulary-sharded DTensor logits: torch's
    vocabulary-parallel cross entropy needs its context in forward and backward alike).
    ``boundary_metas``: the boundary descriptions ({stage: [TensorMeta]}, see
    ``shape_inference.local_boundaries``) to use instead of the first step's exchange.
    ``preprocess``: a :class:`~mpipe.Preprocess` tower (a VL model's vision encoder) run with
    MPipe: the schedule becomes ``mpipe(schedule)``, the tower's inputs are step keywords, stage 0
    gets its output under ``preprocess.into``, and the tower's gradients are summed over the
    pipeline ranks at the end of the step.
    """

    generator: Callable[..., PipelineSchedule] | None = None

    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], n_microbatches: int,
                 loss_fn: Callable | None = None, *,
                 arg_specs: Sequence[BatchDimSpec | int | None] | None = None,
                 kwarg_specs: Mapping[str, BatchDimSpec | int | None] | None = None,
                 target_spec: BatchDimSpec | int = BatchDimSpec(0), scale_grads: bool = True,
                 overlap: bool = False, shared_parameters: Sequence[dict[int, str]] | None = None,
                 schedule: PipelineSchedule | None = None, fifo: bool | None = None,
                 dp_group: dist.ProcessGroup | None = None,
                 loss_context: Callable[[], ContextManager] | None = None,
                 boundary_metas: dict[int, list] | None = None, preprocess: Preprocess | None = None,
                 **gen_kwargs):
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not stages:
            raise PipelineError(f"{type(self).__name__}: no stages given")
        self.stages = {s.stage_index: s for s in stages}
        self.group = stages[0].group
        self.pp_rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        n_ranks = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if schedule is None:
            if self.generator is None:
                raise ScheduleError(f"{type(self).__name__}: give a schedule IR")
            schedule = type(self).generator(n_ranks, n_microbatches, **gen_kwargs)
        if schedule.n_ranks != n_ranks:
            raise ScheduleError(f"{schedule.name}: IR has {schedule.n_ranks} ranks, pipeline group has {n_ranks}")
        mine = schedule.stages_of(self.pp_rank)
        if sorted(self.stages) != mine:
            raise ScheduleError(
                f"{schedule.name}: pipeline rank {self.pp_rank} must hold stages {mine}, got "
                f"{sorted(self.stages)}")
        for s in stages:
            if s.num_stages != schedule.n_stages:
                raise ScheduleError(f"{schedule.name}: stage {s.stage_index} says {s.num_stages} stages, "
                                    f"the schedule has {schedule.n_stages}")
        self.preprocess, self.dp_group = preprocess, dp_group
        if preprocess is not None:
            if not isinstance(preprocess, Preprocess):
                raise PipelineError(f"{type(self).__name__}: preprocess must be a Preprocess, got "
                                    f"{type(preprocess).__name__}")
            if not schedule.meta.get("preprocess"):
                schedule = mpipe(schedule.compute_only(), placement=preprocess.placement)
        elif schedule.meta.get("preprocess"):
            raise ScheduleError(f"{schedule.name} runs a preprocess tower: give preprocess=Preprocess(...)")
        self.fsdp = has_fsdp(self.stages)
        lowered = lower(schedule.compute_only(), fsdp=self.fsdp) if not schedule.is_lowered else schedule
        if fifo is None:  # only gloo honours message tags; elsewhere sends must be received in order
            # (a fake group, used by dry runs, carries no messages: order cannot matter there)
            fifo = dist.is_initialized() and dist.get_backend(self.group) not in ("gloo", "fake")
        self.ir = validate_schedule(lowered, n_microbatches, fifo=fifo)
        self.fifo = fifo
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.arg_specs, self.kwarg_specs, self.target_spec = arg_specs, kwarg_specs, target_spec
        self.scale_grads, self.overlap = scale_grads, overlap
        self._metas: dict[tuple, dict] = {}
        self.loss_context = loss_context
        self.boundary_metas = boundary_metas
        if shared_parameters is None:
            shared_parameters = next((getattr(s.module, "tied_groups", None) for s in stages
                                      if getattr(s.module, "tied_groups", None) is not None), [])
        device = stages[0].device
        self.shared = SharedParameters(shared_parameters, self.stages, schedule.stage_to_rank, self.group,
                                       dp_group) if shared_parameters else None
        if self.shared is not None:
            self.shared.broadcast_values(device)

    @classmethod
    def ir(cls, n_ranks: int, n_microbatches: int, **kwargs) -> PipelineSchedule:
        """The compute IR this schedule runs, for simulation and review."""
        if cls.generator is None:
            raise ScheduleError(f"{cls.__name__} has no generator")
        return cls.generator(n_ranks, n_microbatches, **kwargs)

    def step(self, *args, target=None, losses: list | None = None, **kwargs) -> torch.Tensor | None:
        """One training step (forward and backward of every micro-batch; no optimizer step).

        Returns the mean micro-batch loss on the rank holding the last stage, else None; fills
        ``losses`` with the per-micro-batch losses there. A rank that fails inside the step flags
        it for the group (failfast.py): its peers raise PipelinePeerFailedError within seconds
        instead of waiting on its messages until the group times out.
        """
        failure = StepFailure.begin(self.group)
        try:
            return self._step(args, target, losses, kwargs, failure)
        except BaseException as exc:
            if failure is not None and not isinstance(exc, PipelinePeerFailedError):
                failure.fail(exc)
                exc.add_note(f"pipeline step {failure.step}: global rank {failure.rank} failed; its peers were told")
            raise

    def _step(self, args, target, losses, kwargs, failure) -> torch.Tensor | None:
        m = self.n_microbatches
        pre = PreprocessState.begin(self.preprocess, kwargs, m, self.dp_group) \
            if self.preprocess is not None else None
        mb_args, mb_kwargs = split_microbatches(args, kwargs, m, self.arg_specs, self.kwarg_specs)
        last = self.ir.n_stages - 1
        targets = [None] * m
        if last in self.stages:
            if self.loss_fn is not None and target is None:
                raise MicrobatchError("step: the last stage needs target= for loss_fn")
            if target is not None:
                split, _ = split_microbatches([target], None, m, [self.target_spec])
                targets = [t[0] for t in split]
        key = self._agreed_signature(mb_args[0], mb_kwargs[0])
        if key not in self._metas:
            kw0 = mb_kwargs[0]
            if pre is not None and 0 in self.stages and self.boundary_metas is None:
                with torch.no_grad():  # stage 0 needs a tower output to describe its own output
                    out = self.preprocess.module(**pre.inputs_of(0))
                    if self.preprocess.unpack is not None:
                        out = self.preprocess.unpack(flatten(out, "MPipe tower micro-batch 0"))
                    kw0 = {**kw0, self.preprocess.into: out}
            self._metas[key] = self.boundary_metas if self.boundary_metas is not None else \
                infer_boundaries(self.stages, self.ir.stage_to_rank, self.group, mb_args[0], kw0)
        for s in self.stages.values():
            s.clear()
        if self.fsdp:
            prepare_fsdp_backward(self.stages)
        st = StepState(self.stages, mb_args, mb_kwargs, targets, self.loss_fn,
                       1.0 / m if self.scale_grads else 1.0, self._metas[key], m, self.loss_context, pre)
        st.failure = failure
        out = run_program(self.ir, self.pp_rank, self.group, st, self.overlap,
                          fsdp_hooks(self.stages) if self.fsdp else None, post_ahead=not self.fifo)
        if self.shared is not None:
            self.shared.reduce_grads(next(iter(self.stages.values())).device)
        if last not in self.stages or self.loss_fn is None:
            return None
        ordered = [out[i] for i in range(m)]
        if losses is not None:
            losses.extend(ordered)
        return torch.stack(ordered).mean()


    def _agreed_signature(self, args0, kwargs0) -> int:
        """The input signature every pipeline rank uses as its cache key, after checking that
        every rank runs the same schedule shape.

        Only the first stage's rank needs real inputs, so it decides: its signature hash reaches
        the others through one small all-reduce, and all ranks rerun shape inference together
        when it changes (rather than some waiting for descriptions that never come). The same
        all-reduce (MAX over each value and its negation, so every rank learns the range) checks
        that all ranks agree on the micro-batch count, the stage count and the schedule; ranks
        that disagree would otherwise wait on each other's P2P until the group times out.
        """
        mine = zlib.crc32(repr(signature(args0, kwargs0)).encode()) if 0 in self.stages else 0
        if not dist.is_initialized():
            return mine
        shape = self._shape()
        device = next(iter(self.stages.values())).device
        t = torch.tensor([mine] + [x for v in shape.values() for x in (v, -v)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if is_fake(t):  # a dry run (FakeTensorMode on a fake group): no data moved, every rank is this one
            return mine
        got = t.tolist()
        for i, (what, v) in enumerate(shape.items()):
            hi, lo = got[1 + 2 * i], -got[2 + 2 * i]
            if hi != lo:
                shown = {"schedule": f"{self.ir.name} with stage_to_rank {self.ir.stage_to_rank}"}.get(what, v)
                raise ScheduleError(
                    f"{type(self).__name__}: pipeline ranks disagree on {what}: pipeline rank {self.pp_rank} has "
                    f"{shown}, values across ranks range from {lo} to {hi}; every rank must build the schedule "
                    "with the same arguments")
        return int(got[0])

    def _shape(self) -> dict[str, int]:
        """What every rank must agree on before the first P2P (checked by _agreed_signature)."""
        sched = repr((self.ir.name, self.ir.stage_to_rank, self.ir.uses_split_backward)).encode()
        return {"the number of micro-batches": self.n_microbatches, "the number of stages": self.ir.n_stages,
                "schedule": zlib.crc32(sched)}


class ScheduleGPipe(PipelineScheduleRuntime):
    """All forwards then all backwards; one stage per rank."""
    generator = staticmethod(generators.gpipe)


class Schedule1F1B(PipelineScheduleRuntime):
    """One-forward-one-backward; one stage per rank."""
    generator = staticmethod(generators.one_f_one_b)


class ScheduleInterleaved1F1B(PipelineScheduleRuntime):
    """Interleaved 1F1B; stages s, s+p, ... on rank s (give every local stage)."""
    generator = staticmethod(generators.interleaved_1f1b)

    def __init__(self, stages, n_microbatches, loss_fn=None, **kwargs):
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if "n_virtual" not in kwargs and "schedule" not in kwargs:
            kwargs["n_virtual"] = len(stages)
        super().__init__(stages, n_microbatches, loss_fn, **kwargs)


class ScheduleZeroBubble(PipelineScheduleRuntime):
    """ZB-H1: 1F1B with backward split into dx and dw; one stage per rank."""
    generator = staticmethod(generators.zero_bubble_h1)


class ScheduleZBV(PipelineScheduleRuntime):
    """ZBV: two stages per rank in a V (rank r: stages r and 2p-1-r), dx/dw split."""
    generator = staticmethod(generators.zbv)


def stage_placement(schedule_cls: type, n_ranks: int, n_microbatches: int, **kwargs) -> tuple[int, ...]:
    """stage -> pipeline rank for a schedule class: which stages to build on which rank."""
    return schedule_cls.ir(n_ranks, n_microbatches, **kwargs).stage_to_rank

