"""Apply a plan with pp > 1: this rank's stage(s), TP on the tp sub-mesh, EP on ep, FSDP on dp, the schedule.

Order matters and follows the runtime's tested recipe (tests/pipeline/workers.py): the TP styles
go on the whole model first (every rank builds the same model, so the layouts agree across
stages), then the model is cut at the plan's cuts and only the stages the schedule places on
this pipeline rank are kept, then each block of those stages and the stage root are wrapped with
FSDP over dp (tied parameters shared between stages are left out of FSDP: the runtime sums their
gradients across stages itself). Expert parallel is applied with TP, on the whole model; its ep
dimension shards every micro-batch's rows (ep borrows from dp) and averages gradients after the
schedule, with the one-stage runner's code (``autoplan.parallelisms.expert``). ``step`` runs every
micro-batch, then the optimizer.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import hyper_parallel.core.pipeline_parallel as pipe
from autoplan.capture.image_inputs import image_inputs
from autoplan.parallelisms import ApplyTarget
from autoplan.parallelisms.data import dp_group, grad_mesh, plan_dp_mode, unique_params
from autoplan.parallelisms.registry import (after_backward, apply_to_model, apply_to_roots, local_batch,
                                            stage_kwarg_keys, stage_kwargs, step_loss)
from autoplan.plan.forward import lm_loss
from autoplan.plan.held_weights import HeldWeights
from hyper_parallel import loss_parallel
from hyper_parallel.core.compile import compile_parts
from hyper_parallel.core.pipeline_parallel.microbatch import NO_SPLIT
from hyper_parallel.parallel_dims import mesh_roles
from hyper_parallel.core.pipeline_parallel import SCHEDULES, schedule_facts
from hyper_parallel.errors import MeshError, MicrobatchError, PipelineError

log = logging.getLogger(__name__)


def _full_logits_loss(loss_fn: Callable) -> Callable:
    """Loss on plain logits: a DTensor head output is gathered first. Only for plans without
    loss parallel; with it, ``_sharded_logits_loss`` keeps the vocabulary sharded."""
    def fn(logits, targets):
        logits = logits.logits if hasattr(logits, "logits") else logits
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return loss_fn(logits, targets)
    return fn


def _sharded_logits_loss(loss_fn: Callable) -> Callable:
    """Loss parallel on the last stage: ``loss_fn`` gets the vocabulary-sharded DTensor logits as
    they are; the schedule runs it and the last stage's backward inside ``loss_parallel()``
    (``loss_context``), so no rank ever holds full-vocabulary logits."""
    def fn(logits, targets):
        return loss_fn(logits.logits if hasattr(logits, "logits") else logits, targets)
    return fn


class PipelineRunner(HeldWeights):
    """``step((inputs, targets)) -> float``: one training step of this rank's stages; the loss
    returned on every rank is the global one (mean over micro-batches and dp ranks)."""

    def __init__(self, plan, stages, schedule, optimizer, pp_group, root: nn.Module, applied: dict):
        """``root``: the model before the cut (what the stages' keywords are read from);
        ``applied``: what the registry's entries left on this rank (``ApplyTarget.state``: the
        dp, cp and ep sub-meshes, ZeRO-1, expert parallel's gradient sync, ...)."""
        self.plan, self.stages, self.schedule, self.optimizer = plan, stages, schedule, optimizer
        ir = schedule.ir   # the last stage's pipeline rank holds the loss every rank reports
        self.pp_group, self.last_pp_rank = pp_group, ir.stage_to_rank[ir.n_stages - 1]
        self.root, self.applied = root, applied
        idx = {s.stage_index for s in stages}
        self.first, self.last = 0 in idx, schedule.ir.n_stages - 1 in idx

    # what the entries left, by the names callers and tests read
    dp_mesh = property(lambda self: self.applied.get("dp_mesh"))   # gradients averaged over it (dp, or dp x cp)
    cp_mesh = property(lambda self: self.applied.get("cp_mesh"))
    ep_mesh = property(lambda self: self.applied.get("ep_mesh"))
    zero1 = property(lambda self: self.applied.get("zero1"))

    @property
    def model_parts(self) -> list[nn.Module]:
        return [s.module for s in self.stages]

    def local_batch(self, inputs: torch.Tensor, targets: torch.Tensor):
        """This rank's share of a global batch, as ``Runner.local_batch``: rows by its dp (then ep)
        coordinate, then its head and tail chunks of every sequence under context parallelism."""
        return local_batch(self.plan, self.applied, inputs, targets, "PipelineRunner")

    def step_kwargs(self, inputs: torch.Tensor) -> dict:
        """Keywords every stage gets in a step: what a parallelism adds (context parallel: the
        global positions of this rank's tokens); otherwise the sequence length, which a stage that
        receives a sequence shard (sequence parallel) cannot read off its input but builds its
        positions and mask for (split.py), and the token ids, which a forward may read beyond its
        embedding (forward_split.py)."""
        return stage_kwargs(self.applied, self.root, inputs) or \
            {"sequence_length": int(inputs.shape[1]), pipe.STAGE_TOKENS: inputs}

    def data_parallel_step(self) -> bool:
        """After the schedule (which has summed tied parameters across stages): every parallelism's
        gradient work, as ``Runner.data_parallel_step``; True when the optimizer has stepped."""
        return after_backward(self.applied, self.optimizer)

    def step(self, batch, **kwargs) -> float:
        """``kwargs``: the step's other inputs for this rank's rows (a VL model's ``pixel_values``,
        ``input_ids`` with the image tokens placed, ...; every pipeline rank passes them: stage 0
        or any MPipe owner runs the tower, every stage may read the token ids). Without them the
        model's hook or derived image inputs are used, as ``Runner.step``."""
        inputs, targets = batch
        if not kwargs and self.root is not None:
            inputs, kwargs = microbatch_image_inputs(self.root, inputs, self.schedule.n_microbatches)
        kwargs = dict(kwargs)
        inputs = kwargs.pop("input_ids", inputs)
        self.optimizer.zero_grad()
        args = (inputs,) if self.first else ()
        loss = self.schedule.step(*args, target=targets if self.last else None, **self.step_kwargs(inputs), **kwargs)
        if not self.data_parallel_step():
            self.optimizer.step()
        value = torch.zeros((), dtype=torch.float64)
        if loss is not None:
            loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
            value = loss.detach().to(torch.float64).reshape(())
        src = dist.get_global_rank(self.pp_group, self.last_pp_rank)
        dist.broadcast(value, src=src, group=self.pp_group)
        for mesh in (self.dp_mesh, self.ep_mesh):   # every rank's loss is its batch shard's mean
            if mesh is not None and mesh.size() > 1:
                dist.all_reduce(value, group=dp_group(mesh))
                value /= mesh.size()
        return float(value)


def microbatch_image_inputs(model: nn.Module, tokens: torch.Tensor, m: int) -> tuple[torch.Tensor, dict]:
    """(token ids with the image tokens placed, the step's image keywords) for ``m`` micro-batches
    of ``tokens``' rows, from the model's hook or derived image inputs (none for a text model).
    Each micro-batch's are built for its own rows (``PerMicrobatch``): a grid model's inputs span
    all of a batch's images (cumulative lengths, window indices) and no split of the whole batch's
    gives a micro-batch's."""
    make = image_inputs(model)
    if make is None:
        return tokens, {}
    if tokens.shape[0] % m:
        raise MicrobatchError(f"PipelineRunner.step: {tokens.shape[0]} rows do not split into the plan's {m} "
                              "micro-batches")
    parts = [dict(make(rows)) for rows in tokens.tensor_split(m)]
    ids = torch.cat([p.pop("input_ids", rows) for p, rows in zip(parts, tokens.tensor_split(m))])
    return ids, {k: pipe.PerMicrobatch(p[k] for p in parts) for k in parts[0]}


def rank_parameters(stages, pre: pipe.Preprocess | None) -> list[nn.Parameter]:
    """The parameters a pipeline rank holds and steps, once each (listed twice, a tied parameter
    would be stepped twice): its stages', and an MPipe tower's -- every rank holds the whole tower
    and steps it (its gradients are summed)."""
    return unique_params(*(st.module for st in stages), *((pre.module,) if pre is not None else ()))


def plan_preprocess(pre_cfg: dict | None, model: nn.Module, dp_mode: str | None) -> pipe.Preprocess | None:
    """The MPipe tower of a plan's ``pipeline.preprocess`` entry (None without one, and for
    placement "stage0": stage 0 holds the tower and runs it in the model's own forward -- a model
    whose stages run its forward; a model with a spine takes its tower output only from MPipe).
    "own_stage" is priced, not run. With data parallel the MPipe tower is a replica averaged over
    dp by the schedule, which it does only under FSDP (``dp_group``)."""
    if not pre_cfg:
        return None
    placement, module = pre_cfg["placement"], pre_cfg["module"]
    runs = pipe.image_features.runnable_placements(module)
    if placement not in runs:
        raise PipelineError(f"plan.apply: pipeline.preprocess.placement={placement!r} is priced only; for tower "
                            f"{module!r} the runtime runs {list(runs)}")
    if placement == "stage0":
        return None
    if dp_mode not in (None, "fsdp"):
        raise PipelineError(f"plan.apply: an MPipe tower with {dp_mode} data parallel is not supported (its "
                            "gradients are averaged over dp by the schedule under FSDP only); valid: dp=1 or fsdp")
    if module == pipe.image_features.METHOD:
        tower = pipe.ImageFeatures(model)
        return pipe.Preprocess(tower, tuple(pre_cfg["inputs"]), into=pre_cfg["into"], unpack=tower.unpack,
                               keep=tuple(pre_cfg.get("keep", ())), placement=pre_cfg.get("owner_placement", "front"))
    try:
        tower = model.get_submodule(module)
    except AttributeError:
        raise PipelineError(f"plan.apply: pipeline.preprocess.module={module!r} is not a submodule of "
                            f"{type(model).__name__}") from None
    return pipe.Preprocess(tower, tuple(pre_cfg["inputs"]), into=pre_cfg.get("into", "vision"),
                           placement=pre_cfg.get("owner_placement", "front"))


def apply_pipeline_plan(plan, model: nn.Module, mesh, *, optimizer=None, lr: float = 1e-3,
                        loss_fn: Callable | None = None, compile=None) -> PipelineRunner:
    """Build this rank's pipeline from ``plan.pipeline`` on ``mesh`` (dims named as in the plan).

    ``compile``: as ``apply_plan``'s; "blocks" compiles the blocks of this rank's stages, "model"
    each of its stage modules (and an MPipe tower).

    ``optimizer``: None (AdamW over this rank's parameters) or a factory ``params -> Optimizer``
    (parameters change identity under FSDP, so an optimizer made beforehand would miss them).
    """
    pipe_cfg = plan.pipeline
    names = tuple(mesh.mesh_dim_names or ())
    pp_name = mesh_roles(names).get("pp")  # "pp", "pipe" or "pipeline": the mesh-name vocabulary
    if pp_name is None:
        raise MeshError(f"plan.apply: a pipelined plan needs a pipeline mesh dimension ('pp'), got {names}")
    p, m, sched_name = int(pipe_cfg["pp"]), int(pipe_cfg["microbatches"]), pipe_cfg["schedule"]
    if mesh[pp_name].size() != p:
        raise MeshError(f"plan.apply: plan has pp={p}, mesh has {pp_name}={mesh[pp_name].size()}")
    facts = schedule_facts(sched_name, "plan.pipeline['schedule']")
    if plan.recompute_mode == "selective" and facts.split_backward:
        whole = [n for n, f in SCHEDULES.items() if not f.split_backward]
        raise MeshError(f"plan.apply: selective recomputation cannot run under {sched_name} (its weight "
                        "gradients are a second backward pass; torch's selective checkpointing allows one); "
                        f"use one of {whole}, or recompute none/full")
    # the registry's order with the pipeline around it: the whole model first (tensor parallel,
    # so every stage's layouts agree), then this rank's stages, then the rest on the stages
    target = ApplyTarget(model=model, mesh=mesh, pipelined=True)
    pipe.prepare_split(model)   # the stages run the model's forward: read it before TP shards the modules
    apply_to_model(plan, target)
    tp_mesh = target.state.get("tp_mesh")
    cls = facts.schedule_class
    kwargs = facts.generator_kwargs(int(pipe_cfg["virtual_stages"]))
    ir = cls.ir(p, m, **kwargs)
    pp_group = mesh[pp_name].get_group()
    pre_cfg = pipe_cfg.get("preprocess") or {}
    stages = pipe.build_stages(model, ir, group=pp_group, cuts=list(pipe_cfg["cuts"]),
                               activation_mesh=tp_mesh, side=pre_cfg.get("placement") != "mpipe")
    blocks = sorted({d["block_prefix"] for d in plan.decisions if d.get("block_prefix")})
    target.roots = [st.module for st in stages]
    target.block_finder = [st.module.get_submodule(u) for st in stages for u in st.module.units
                           if any(u.startswith(b + ".") for b in blocks)]
    mode = plan_dp_mode(plan)
    dp_mesh = grad_mesh(plan, mesh)   # 2-D (dp_replicate, dp_shard) for HSDP; dp x cp flattened with cp
    use_dp = dp_mesh is not None and dp_mesh.size() > 1
    if use_dp and mode == "fsdp":
        # parameters shared across stages (tied embedding / head) are reduced by the schedule, not FSDP
        tied = {id(prm) for st in stages for g in st.module.tied_groups
                for s, fqn in g.items() if s == st.stage_index for prm in [st.module.get_parameter(fqn)]}
        target.ignored_params = {prm for st in stages for prm in st.module.parameters() if id(prm) in tied}
    apply_to_roots(plan, target)
    pre = plan_preprocess(pipe_cfg.get("preprocess"), model, mode if use_dp else None)
    sharded_loss = bool(plan.loss_parallel) and tp_mesh is not None
    own = step_loss(target.state, None if loss_fn is None or loss_fn is lm_loss else loss_fn, "plan.apply")
    loss = (_sharded_logits_loss if sharded_loss else _full_logits_loss)(own or lm_loss)
    step_keys = stage_kwarg_keys(target.state, model)
    schedule = cls(stages, m, loss, dp_group=dp_group(dp_mesh) if use_dp and mode == "fsdp" else None,
                   loss_context=loss_parallel if sharded_loss else None, preprocess=pre,
                   **({"kwarg_specs": {k: NO_SPLIT for k in step_keys}} if step_keys else {}), **kwargs)
    params = rank_parameters(stages, pre)
    if optimizer is None:
        optimizer = torch.optim.AdamW(params, lr=lr)
    elif callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = optimizer(params)
    runner = PipelineRunner(plan, stages, schedule, optimizer, pp_group, root=model, applied=target.state)
    runner.compiled = compile_parts(compile, target.block_finder,
                                    [st.module for st in stages] + ([pre.module] if pre is not None else []),
                                    where="plan.apply (pipeline)")
    return runner
