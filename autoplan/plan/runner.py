"""Apply a Plan with hyper_parallel and train: the one call between a plan file and a step.

``apply_plan`` checks the mesh against the plan, applies each parallelism the plan decides
through its registry entry (tensor parallel on the tp dimension, context parallel on cp,
recomputation, FSDP2 / HSDP on the dp dimensions -- folded with cp), and returns a Runner whose ``step((inputs, targets))`` runs forward, loss (vocabulary-parallel
when the plan chose loss parallel), backward -- once per micro-batch when the plan's one stage
accumulates gradients over ``pipeline.microbatches`` -- and the optimizer step.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autoplan.errors import InvalidArgumentError
from autoplan.parallelisms import ApplyTarget
from autoplan.parallelisms.registry import after_backward, apply_to_model, apply_to_roots, local_batch, step_loss
from autoplan.plan.forward import forward_tokens, lm_loss, output_logits
from autoplan.plan.pipeline_runner import apply_pipeline_plan
from autoplan.plan.held_weights import HeldWeights
from autoplan.plan.weights import ModelInit
from hyper_parallel import loss_parallel
from hyper_parallel.core.async_tp import enable_async_tp
from hyper_parallel.core.compile import CompileSpec, compile_parts
from hyper_parallel.core.pipeline_parallel import split_microbatches
from hyper_parallel.errors import AsyncTPError, CompileError, MeshError, MicrobatchError
from hyper_parallel.platform import current_device

log = logging.getLogger(__name__)


class Runner(HeldWeights):
    """One training step of a plan without a pipeline (or with one stage that accumulates).

    What each parallelism does inside a step -- its share of the batch, a loss it replaces, its
    gradient work after backward -- comes from the registry entries (``autoplan.parallelisms``)
    through ``applied``, what their apply steps left on this rank (``ApplyTarget.state``); the
    runner names none of them."""

    def __init__(self, model: nn.Module, plan, optimizer: torch.optim.Optimizer, loss_fn: Callable | None,
                 applied: dict, microbatches: int = 1):
        self.model = model
        self.plan = plan
        self.optimizer = optimizer
        self.applied = applied
        self.loss_fn = step_loss(applied, loss_fn, "plan.apply") or lm_loss   # a refusal fails before any step
        self.microbatches = microbatches  # gradient accumulation: forward + backward per micro-batch

    # what the entries left, by the names callers and tests read
    dp_mesh = property(lambda self: self.applied.get("dp_mesh"))   # gradients averaged over it (dp, or dp x cp)
    cp_mesh = property(lambda self: self.applied.get("cp_mesh"))
    ep_mesh = property(lambda self: self.applied.get("ep_mesh"))
    zero1 = property(lambda self: self.applied.get("zero1"))

    def data_parallel_step(self) -> bool:
        """Every parallelism's gradient work after backward (expert parallel's sync over ep, then
        replicated dp's all-reduce or ZeRO-1's sharded step); True when the optimizer has stepped."""
        return after_backward(self.applied, self.optimizer)

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's share of a global batch: rows by its dp (then ep) coordinate, then its
        head and tail chunks of each sequence under context parallelism."""
        return local_batch(self.plan, self.applied, inputs, targets, "Runner")

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The step's loss on this rank's tokens (context parallel: the exact global mean)."""
        return self.loss_fn(logits, targets)

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor, on_phase: Callable | None = None,
                         **extra):
        """Forward and backward of this rank's local batch as ``self.microbatches`` equal
        micro-batches of rows (gradient accumulation); returns the step's loss (detached).

        Each micro-batch's loss is scaled by 1/m, so the accumulated gradient is the gradient of
        the mean over the micro-batches: the full-batch mean when every micro-batch has the same
        number of counted tokens (equal rows of equal length, no ignored targets) -- for context
        parallelism too, where ``cp_cross_entropy`` is each micro-batch's exact global mean.
        FSDP2 reduce-scatters each micro-batch's gradients inside its backward and accumulates
        the sharded result, as torchtitan does: gradients and parameters stay sharded between
        micro-batches (memory is one micro-batch's activations plus the shards), at the price of
        gathering the parameters and reducing the gradients once per micro-batch. Replicated data
        parallel, ZeRO-1, expert parallel's gradient sync and FSDP's left-out parameters reduce
        once per step, after the last micro-batch (``data_parallel_step``): their gradients are
        whole on every rank anyway, so accumulating first costs no memory and saves m-1
        reductions. The split is checked before any forward and depends only on the local shape,
        which every rank of the plan shares, so a bad batch fails the same way on every rank
        (MicrobatchError) and never leaves a collective waiting. ``on_phase("forward" |
        "backward")`` is told before each pass (verify's dry run attributes collectives by it)."""
        m = self.microbatches
        if inputs.shape[0] % m:
            raise MicrobatchError(f"Runner.step: this rank's local batch has {inputs.shape[0]} rows, which the plan's "
                                  f"pipeline.microbatches={m} (gradient accumulation) do not divide; give a batch "
                                  f"with a multiple of {m} rows per data-parallel rank")
        for key, value in extra.items():
            if m > 1 and (not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != inputs.shape[0]):
                raise MicrobatchError(f"Runner.step: input {key!r} is not batch-major (dim 0 of {inputs.shape[0]} rows), "
                                      f"so it cannot be split into the plan's {m} micro-batches; give a plan with "
                                      f"pipeline.microbatches=1 or batch-major inputs")
        if m > 1:
            arg_parts, kw_parts = split_microbatches((inputs, targets), extra, m)
            parts = list(zip(arg_parts, kw_parts))
        else:
            parts = [((inputs, targets), extra)]
        phase = on_phase or (lambda name: None)
        total = None
        for (x, y), kw in parts:
            phase("forward")
            logits = output_logits(forward_tokens(self.model, x, **kw))
            with loss_parallel() if isinstance(logits, DTensor) else contextlib.nullcontext():
                loss = self.loss(logits, y) / m
                phase("backward")
                loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total

    def step(self, batch, **extra) -> float:
        """One training step on this rank's ``(inputs, targets)``; returns the loss (the mean over
        the step's micro-batches). ``extra``: the step's other inputs for this rank's rows (a VL
        model's ``pixel_values``, ``input_ids`` with image tokens placed, ...), as the pipeline
        runner takes them; without them the model's hook or derived image inputs are used."""
        inputs, targets = batch
        self.optimizer.zero_grad()
        loss = self.forward_backward(inputs, targets, **extra)
        if not self.data_parallel_step():
            self.optimizer.step()
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return float(value)


def _check_mesh(plan, mesh) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    want = tuple(plan.mesh["names"])
    if names != want or tuple(mesh.shape) != tuple(plan.mesh["shape"]):
        raise MeshError(f"plan.apply: the plan is for a mesh of shape {tuple(plan.mesh['shape'])} named {want}, "
                        f"got shape {tuple(mesh.shape)} named {names}")


def _check_model(plan, model: nn.Module) -> None:
    """A plan is for one model class: its styles name that class's modules, and the soundness
    checks (which parameters need their gradients reduced) ran on its code. Applied to another
    class whose module names happen to match (a Llama plan on Qwen3: the same projections, but
    q/k norms the plan never saw), it would train wrong without an error."""
    planned = (plan.model or {}).get("type")
    given = f"{type(model).__module__}.{type(model).__qualname__}"
    if planned and planned != given:
        raise InvalidArgumentError(f"plan.apply: the plan was made for a {planned}, the model is a {given}; plan "
                                   "this model (autoplan / plan_cluster) and apply that plan")


def _enable_async_tp(plan, mesh) -> None:
    """Async TP for ``plan`` on ``mesh``, or its refusal -- before any parallelism touches the
    model. It fuses the sequence-parallel all-gathers and reduce-scatters with their matmuls, so a
    plan without a sequence-parallel stream has nothing for it to do and is refused too."""
    if plan.stream_layout != "S":
        raise AsyncTPError(f"plan.apply: compile async_tp=True, but the plan's stream layout is "
                           f"{plan.stream_layout!r}: its tensor-parallel collectives are all-reduces, which async TP "
                           "does not fuse; it needs a sequence-parallel plan (stream layout 'S')")
    names = tuple(mesh.mesh_dim_names or ())
    enable_async_tp(mesh[plan.tp_dim] if plan.tp_dim in names else None, "plan.apply")


def _runs(module: nn.Module) -> bool:
    """Whether ``module`` has a forward of its own (a ModuleList / ModuleDict only holds others)."""
    return type(module).forward is not nn.Module.forward


def _blocks_in(container: nn.Module) -> list[nn.Module]:
    """The modules that run among ``container``'s children: a child that only holds others (a
    stage of Florence-2's DaViT tower is a ModuleList of blocks) stands for its own children,
    since FSDP and checkpointing wrap what runs, and refuse a container without a forward."""
    out: list[nn.Module] = []
    for child in container.children():
        out.extend([child] if _runs(child) else _blocks_in(child))
    return out


def block_modules(model: nn.Module, plan) -> list[nn.Module]:
    """The repeated blocks (what torchtitan wraps for FSDP and checkpoints), from the plan's
    decisions: every module that runs among each block container's children."""
    units = []
    prefixes = sorted({d["block_prefix"] for d in plan.decisions if d.get("block_prefix") is not None})
    for prefix in prefixes:
        units.extend(_blocks_in(model.get_submodule(prefix)))
    return units


def apply_plan(plan, model: nn.Module, mesh, *, optimizer: torch.optim.Optimizer | None = None, lr: float = 1e-3,
               loss_fn: Callable = lm_loss, compile=None):
    """Apply every parallelism of ``plan`` in the registry's order (``autoplan.parallelisms``):
    those applied to the whole model (tensor parallel), then -- with a pipeline, after cutting
    this rank's stages -- those applied to the roots (recomputation, then FSDP / HSDP).

    ``compile``: None / "none" (eager), "blocks" (each repeated block, torchtitan's recipe),
    "model" (each root whole), or a dict / :class:`~hyper_parallel.core.compile.CompileSpec` with
    the backend and torch mode (docs/compile.md). Compiled in place after everything else, so
    parameters and state-dict keys are the eager ones; ``runner.compiled.stats()`` counts graphs
    and graph breaks.

    ``model`` may be on the meta device (nothing larger than one device can be built otherwise):
    then ``runner.materialize(seed)`` or ``runner.load_pretrained(path)`` gives this rank's shards
    their values."""
    _check_mesh(plan, mesh)
    _check_model(plan, model)
    spec = CompileSpec.of(compile)   # a bad setting fails before the model is touched
    if spec.async_tp:
        _enable_async_tp(plan, mesh)
    if spec.enabled and plan.recompute_mode == "selective":
        raise CompileError(f"plan.apply: compile={spec.mode!r} with selective recomputation (parallel.ac.mode="
                           "'selective'): its policy tells the attention core's ops from the projections' by "
                           "module hooks at run time, which dynamo cannot trace; use compile='none', or "
                           "recompute 'full' or 'none'")
    init = ModelInit.of(model)   # before any parallelism changes the model: for materialize / load
    if plan.pipeline and int(plan.pipeline.get("pp", 1)) > 1:
        runner = apply_pipeline_plan(plan, model, mesh, optimizer=optimizer, lr=lr, loss_fn=loss_fn, compile=spec)
    else:
        runner = _apply_one_stage(plan, model, mesh, optimizer=optimizer, lr=lr, loss_fn=loss_fn)
        runner.compiled = compile_parts(spec, block_modules(model, plan), [model], where="plan.apply")
    runner.model_init, runner.device = init, current_device(mesh.device_type)
    return runner


def _apply_one_stage(plan, model: nn.Module, mesh, *, optimizer, lr: float, loss_fn: Callable) -> Runner:
    target = ApplyTarget(model=model, mesh=mesh, roots=[model], block_finder=lambda: block_modules(model, plan))
    apply_to_model(plan, target)
    apply_to_roots(plan, target)
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr)
    return Runner(model, plan, optimizer, None if loss_fn is lm_loss else loss_fn, target.state,
                  microbatches=int((plan.pipeline or {}).get("microbatches", 1)))
