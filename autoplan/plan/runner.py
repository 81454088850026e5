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
from autoplan.parallelisms.context import cp_share
from autoplan.parallelisms.data import Zero1, allreduce_gradients, dp_group, dp_share, unique_params
from autoplan.parallelisms.registry import apply_to_model, apply_to_roots
from autoplan.plan.forward import forward_tokens, lm_loss, output_logits
from autoplan.plan.pipeline_runner import apply_pipeline_plan
from autoplan.plan.held_weights import HeldWeights
from autoplan.plan.weights import ModelInit
from hyper_parallel import cp_cross_entropy, loss_parallel
from hyper_parallel.core.compile import CompileSpec, compile_parts
from hyper_parallel.core.pipeline_parallel import split_microbatches
from hyper_parallel.errors import CompileError, MeshError, MicrobatchError
from hyper_parallel.platform import current_device

log = logging.getLogger(__name__)


class Runner(HeldWeights):
    def __init__(self, model: nn.Module, plan, optimizer: torch.optim.Optimizer, loss_fn: Callable, dp_mesh=None,
                 replicate_dp: bool = False, zero1: Zero1 | None = None, batch_mesh=None, cp_mesh=None,
                 ep_mesh=None, ep_sync=None, fsdp_replicated=(), microbatches: int = 1):
        self.model = model
        self.plan = plan
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.dp_mesh = dp_mesh            # gradients are averaged over it (dp, or dp x cp flattened)
        self.batch_mesh = dp_mesh if batch_mesh is None and cp_mesh is None else batch_mesh  # splits batch rows
        self.cp_mesh = cp_mesh            # context parallel: splits each sequence (head + tail chunks)
        self.replicate_dp = replicate_dp  # replicated data parallel: average gradients after backward
        self.zero1 = zero1                # ZeRO-1: sharded optimizer step after backward
        self.ep_mesh = ep_mesh            # expert parallel: the ep dimension shards the batch too
        self.ep_sync = ep_sync            # ... and averages gradients over it (parallelisms.expert)
        self.fsdp_replicated = list(fsdp_replicated)   # left out of FSDP: gradients averaged over dp
        self.microbatches = microbatches  # gradient accumulation: forward + backward per micro-batch

    def data_parallel_step(self) -> bool:
        """What follows backward on the dp group: replicated dp all-reduces the gradients;
        ZeRO-1 reduce-scatters them, steps this rank's slice and all-gathers the parameters
        (returns True: the optimizer has stepped). FSDP did its part inside backward. Expert
        parallel's ep dimension first averages the gradients over its batch shards."""
        if self.ep_sync is not None:
            self.ep_sync()
        if self.zero1 is not None:
            self.zero1.step(self.optimizer)
            return True
        if self.replicate_dp:
            allreduce_gradients(unique_params(self.model), self.dp_mesh.get_group(), self.dp_mesh.size())
        elif self.fsdp_replicated:
            allreduce_gradients(self.fsdp_replicated, dp_group(self.dp_mesh), self.dp_mesh.size())
        return False

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's share of a global batch: rows by its dp coordinate (then by its ep
        coordinate when the plan's ep dimension shards the batch), then (context parallel) its
        head and tail chunks of each sequence."""
        inputs, targets = dp_share(inputs, targets, self.batch_mesh, "Runner")
        inputs, targets = dp_share(inputs, targets, self.ep_mesh, "Runner")
        return cp_share(inputs, targets, self.cp_mesh)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The step's loss on this rank's tokens. Context parallel: ``cp_cross_entropy`` over the
        gradient mesh -- the exact mean over the global batch, with a gradient scaled for the
        averaging reduction over dp x cp that follows (FSDP's or the flat all-reduce)."""
        if self.cp_mesh is not None:
            return cp_cross_entropy(logits, targets, self.dp_mesh)
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


def block_modules(model: nn.Module, plan) -> list[nn.Module]:
    """The repeated blocks (what torchtitan wraps for FSDP and checkpoints), from the plan's
    decisions: every child of each block container."""
    units = []
    prefixes = sorted({d["block_prefix"] for d in plan.decisions if d.get("block_prefix") is not None})
    for prefix in prefixes:
        parent = model.get_submodule(prefix)
        units.extend(parent.children())
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
    dp_mesh, mode = target.state.get("dp_mesh"), target.state.get("dp_mode")
    cp_mesh = target.state.get("cp_mesh")
    if cp_mesh is not None and loss_fn is not lm_loss:
        raise InvalidArgumentError(f"plan.apply: loss_fn={getattr(loss_fn, '__name__', loss_fn)!r} with context "
                                   "parallelism; the loss of a cp plan is the token cross entropy over the global "
                                   "batch (cp_cross_entropy); omit loss_fn")
    use_dp = dp_mesh is not None and dp_mesh.size() > 1
    zero1 = Zero1(unique_params(model), dp_mesh.get_group(), dp_mesh.size(), dp_mesh.get_local_rank()) \
        if mode == "zero1" and use_dp else None
    optimizer = optimizer or torch.optim.AdamW(model.parameters(), lr=lr)
    return Runner(model, plan, optimizer, loss_fn, dp_mesh, replicate_dp=use_dp and mode == "replicate", zero1=zero1,
                  batch_mesh=target.state.get("batch_mesh"), cp_mesh=cp_mesh,
                  ep_mesh=target.state.get("ep_mesh"), ep_sync=target.state.get("ep_sync"),
                  fsdp_replicated=target.state.get("fsdp_replicated", ()) if mode == "fsdp" and use_dp else (),
                  microbatches=int((plan.pipeline or {}).get("microbatches", 1)))
