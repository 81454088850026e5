"""The training loop: model, plan, optimizer, data, checkpoints, progress — one Trainer.

``Trainer(cfg)`` builds the model on the meta device (no memory), applies the plan there with
hyper_parallel (TP styles, pipeline stages, FSDP or replicated data parallel), makes AdamW over
this rank's parameters, and only then gives this rank's shards memory and values: the
pretrained weights of a ``--model`` directory (each rank reading its slices), or the seed's
plan-independent initial weights; with ``cfg.resume``, a checkpoint resharded to this plan.
No rank ever holds the whole model.
``fit()`` runs the steps: the learning rate is a pure function of the step (so nothing about the
schedule needs saving), every rank reads the same global batch and keeps its dp share, the loss
reported is the global mean. bf16 autocast on accelerators (``mixed_precision="auto"``), fp32 on
the CPU so CPU runs are exactly comparable across plans.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from autoplan.plan.held import held_module
from autoplan.train import checkpoint, checkpoint_key, manifest, restart
from autoplan.train.config import TrainConfig
from autoplan.train.data import token_stream
from autoplan.train.env import device_type, init_distributed, plan_mesh
from autoplan.train.errors import DivergenceError, TrainConfigError
from autoplan.train.guard import GradClipper, check_loss
from autoplan.train import images
from autoplan.train.metrics import MetricsWriter, memory_gib, peak_flops
from hyper_parallel.core.compile import CompileSpec, default_compile_mode
from hyper_parallel.core.float8 import float8_summary
from hyper_parallel.errors import CompileError
from autoplan.train.model import build_model, flops_per_token, pretrained_weights
from autoplan.train.plan_source import check_ranks_agree, plan_for
from autoplan.train.progress import Progress
from autoplan.train.quiet import quiet_known_warnings

log = logging.getLogger(__name__)


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Learning rate of step ``step`` (0-based): linear warmup, then constant, cosine or linear decay."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, cfg.steps - cfg.warmup)
    frac = min(1.0, (step - cfg.warmup) / span)
    if cfg.schedule == "cosine":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
    if cfg.schedule == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * frac
    raise TrainConfigError(f"train: --schedule {cfg.schedule!r}: use constant, cosine or linear")


def _vocab(model) -> int:
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg   # a VL model: its decoder's
    return int(getattr(cfg, "vocab_size"))


@dataclass
class TrainResult:
    start_step: int
    step: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[str] = field(default_factory=list)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]


def compile_spec(cfg: TrainConfig, device: torch.device) -> CompileSpec:
    """The run's torch.compile setting: ``--compile auto`` is per-block on accelerators and eager on CPU."""
    mode = default_compile_mode(device.type) if cfg.compile == "auto" else cfg.compile
    if mode == "model" and cfg.compile_backend == "inductor" and dist.is_initialized() and dist.get_world_size() > 1:
        # Seen on titan-llama-debug at dp=2 x tp=2: the whole model compiled by inductor inside this
        # trainer stops at its first step unable to resolve a process group by name, while the same plan
        # compiled through plan.apply trains. Until the cause is found the combination is refused here,
        # before any step, rather than left to crash.
        raise TrainConfigError("train: --compile model with --compile-backend inductor on several ranks is not "
                               "supported yet (its first step fails to resolve a process group); valid: --compile "
                               "blocks (per block, the default on accelerators), or --compile-backend aot_eager")
    try:
        return CompileSpec(mode=mode, backend=cfg.compile_backend, torch_mode=cfg.compile_mode, async_tp=cfg.async_tp)
    except CompileError as e:   # --async-tp with an eager (or non-inductor) run: said as the flags
        raise TrainConfigError(f"train: --async-tp with --compile {cfg.compile} (here {mode!r}) and --compile-backend "
                               f"{cfg.compile_backend}: {e}; valid: --compile blocks|model with inductor") from None


class Trainer:
    """One training run on this rank; every rank of the job constructs one with the same config."""

    def __init__(self, cfg: TrainConfig, plan=None):
        if cfg.mixed_precision not in ("auto", "bf16", "fp32"):
            raise TrainConfigError(f"train: --mixed-precision {cfg.mixed_precision!r}: use auto, bf16 or fp32")
        lr_at(cfg, 0)  # a bad schedule name fails before any work
        cfg.check()    # so does a meaningless setting (--steps 0, --checkpoint-every without a directory)
        self.cfg = cfg
        self.key = checkpoint_key.resolve(cfg.checkpoint_key)   # None: checkpoints carry integrity only
        if plan is None and not dist.is_initialized():  # plan while nothing else runs; same plan after (plan_source)
            plan = plan_for(cfg, int(os.environ.get("WORLD_SIZE", "1")), torch.device(device_type()))
        self.device = init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if plan is None:
            plan = plan_for(cfg, self.world, self.device)
        else:   # planned before the group was up, or given: the ranks must hold the same one
            check_ranks_agree(plan)
        self.plan = plan
        self.mesh = plan_mesh(self.plan, self.device)
        self._check_batch()
        # image-text data: the loss is the global batch's token mean (images.GlobalTokenMeanLoss)
        self.image_loss = images.GlobalTokenMeanLoss() if images.data_format(cfg) == "image-text" else None
        if self.image_loss is not None:
            images.check_plan(self.plan)
        weights = pretrained_weights(cfg)  # a bad --init or missing weights fail before any work
        self.model = build_model(cfg.model, layers=cfg.layers, overrides=cfg.model_args, device="meta")
        self.flops_per_token = flops_per_token(self.model, cfg.seq)
        image_source = images.open_image_text(cfg, self.model) if self.image_loss is not None else None
        loss = {"loss_fn": self.image_loss} if self.image_loss is not None else {}
        self.runner = self.plan.apply(self.model, self.mesh, optimizer=self._optimizer,
                                      compile=compile_spec(cfg, self.device), **loss)
        if not hasattr(self.runner, "stages"):  # FSDP/TP replaced the parameters: optimizer over the new ones
            self.runner.optimizer = self._optimizer(self.model.parameters())
        start = restart.start_point(cfg, self.key)  # --resume auto|latest|never|PATH, collective
        if weights is not None and start is None:
            self.runner.load_pretrained(weights, seed=cfg.seed)
            log.info("weights: loaded from %s (each rank read its slices)", weights)
        else:   # a resume overwrites every parameter: the init only gives them memory (and buffers values)
            self.runner.materialize(seed=cfg.seed)
            if start is None:
                log.info("weights: initialised from seed %d (the same under every plan)", cfg.seed)
        float8 = float8_summary(held_module(self.runner))   # what runs here: a plan's float8 that did not apply shows
        if float8:
            log.info("%s", float8)
        self.bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and self.device.type != "cpu")
        self.peak = peak_flops(self.plan.mesh.get("hardware"), torch.bfloat16 if self.bf16 else torch.float32) \
            if self.rank == 0 else None  # rank 0 reports
        self.data = images.image_batches(image_source, cfg, self.runner) if image_source is not None else \
            token_stream(cfg.data, batch=cfg.batch, seq=cfg.seq, vocab=_vocab(self.model), seed=cfg.seed,
                         tokenizer=cfg.tokenizer, token_dtype=cfg.token_dtype)
        self.step = 0
        if start is not None:
            self.resume(start)

    def _check_batch(self) -> None:
        """The global batch must split over dp and into the plan's micro-batches (a pipeline's, or
        one stage's gradient accumulation)."""
        names, shape = self.plan.mesh["names"], self.plan.mesh["shape"]
        dp = shape[names.index(self.plan.dp_dim)] if self.plan.dp_dim in names else 1
        m = int((self.plan.pipeline or {}).get("microbatches", 1))
        if self.cfg.batch % (dp * m):
            raise TrainConfigError(
                f"train: --batch {self.cfg.batch} must be a multiple of dp={dp} x micro-batches={m} = {dp * m} "
                f"for this plan (it was made for a global batch of {self.plan.batch.get('global_batch')})")

    def _optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(list(params), lr=self.cfg.lr, betas=tuple(self.cfg.betas),
                                 weight_decay=self.cfg.weight_decay)

    # ------------------------------------------------------------------ checkpoints
    def resume(self, path) -> None:
        state = checkpoint.load(self.runner, self.model, path, key=self.key)
        saved = state.get("config", {})
        changed = [k for k in ("data", "batch", "seq", "seed") if k in saved and saved[k] != getattr(self.cfg, k)]
        if changed:
            log.warning("resume: %s differ from the checkpoint's (%s); the data position %s no longer "
                        "continues the same stream", ", ".join(changed),
                        ", ".join(f"{k}={saved[k]!r}" for k in changed), state["data"])
        self.step = int(state["step"])
        self.data.restore(state["data"])

    def save(self, integrity: bool = True) -> str:
        """Save this step and wait for the manifest (collective)."""
        return str(self.begin_save(integrity).finish())

    def begin_save(self, integrity: bool = True) -> checkpoint.PendingSave:
        """Write this step's files; the manifest is hashed in the background until ``.finish()``."""
        state = {"data": self.data.state(), "config": self.cfg.to_dict(), "plan_mesh": self.plan.mesh,
                 "world": self.world}
        info = {"plan_mesh": self.plan.mesh, "world": self.world, "model": manifest.fingerprint(self.model)}
        return checkpoint.begin_save(self.runner, self.cfg.checkpoint_dir, self.step, state, info, integrity, self.key)

    def gathered_state(self) -> dict[str, Any]:
        """Full parameters and optimizer state by FQN (collective); for checks on small models."""
        return checkpoint.gathered_state(self.runner)

    # ------------------------------------------------------------------ steps
    def _global_loss(self, loss: float) -> float:
        """The global batch's mean: each rank's loss is its batch shard's -- by its dp coordinate,
        then by its ep coordinate when expert parallelism shards the batch (the pipeline runner
        already returns the mean over both)."""
        if hasattr(self.runner, "stages"):
            return loss
        meshes = [m for m in (getattr(self.runner, "dp_mesh", None), getattr(self.runner, "ep_mesh", None))
                  if m is not None and m.size() > 1]
        if not meshes:
            return loss
        t = torch.tensor(loss, dtype=torch.float64, device=self.device)
        shards = 1
        for m in meshes:
            dist.all_reduce(t, group=m.get_group())
            shards *= m.size()
        return float(t) / shards

    def train_step(self) -> dict[str, Any]:
        lr = lr_at(self.cfg, self.step)
        for group in self.runner.optimizer.param_groups:
            group["lr"] = lr
        extra = {}
        if self.image_loss is not None:   # this rank's rows already, with the model's other inputs
            inputs, targets, extra = self.data.next()
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            extra = {k: v.to(self.device) for k, v in extra.items()}
            self.image_loss.set_for(targets, images.batch_meshes(self.runner), self.runner.microbatches)
        else:
            inputs, targets = self.data.next()
            inputs, targets = self.runner.local_batch(inputs.to(self.device), targets.to(self.device))
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.bf16 else contextlib.nullcontext()
        t0 = time.perf_counter()
        with amp:
            loss = self.runner.step((inputs, targets), **extra)
        step_s = time.perf_counter() - t0
        self.step += 1
        tps = self.cfg.batch * self.cfg.seq / step_s
        mem, kind = memory_gib(self.device)
        row = {"step": self.step, "loss": self._global_loss(loss), "lr": lr, "step_s": step_s,
               "tokens_per_s": tps,
               "mfu": tps * self.flops_per_token / (self.world * self.peak) if self.peak else None,
               "memory_gib": mem, "memory_kind": kind}
        if getattr(self, "_clipper", None) is not None:
            row["grad_norm"] = self._clipper.last_norm
        row.update(self.runner.compiled.stats())   # graphs, graph_breaks (0, 0 in eager)
        return row

    def fit(self, until: int | None = None) -> TrainResult:
        """Train up to step ``until`` (default ``cfg.steps``), saving every ``checkpoint_every``."""
        cfg = self.cfg
        until = cfg.steps if until is None else until
        result = TrainResult(start_step=self.step, step=self.step)
        if self.step >= until:
            log.info("train: at step %d already, --steps %d: nothing to train", self.step, until)
            return result
        quiet_known_warnings(self.rank)   # FSDP2's view-output warning: explained once, see quiet.py
        writer = MetricsWriter(cfg.metrics if self.rank == 0 else None, start_step=self.step)
        progress = Progress(cfg.progress, until, self.step, self.rank, cfg.log_every)
        self._clipper = GradClipper(self.runner, cfg.clip_grad_norm) if cfg.clip_grad_norm else None
        progress.note(f"training {cfg.model} steps {self.step}..{until} on mesh "
                      f"{dict(zip(self.plan.mesh['names'], self.plan.mesh['shape']))}"
                      f"{' (pipeline ' + self.plan.pipeline['schedule'] + ')' if self._pipelined else ''}")
        pending = None   # the last save, hashed in the background while the next step runs
        try:
            while self.step < until:
                row = self.train_step()
                if pending is not None and self._finished(pending, result, progress, wait=False):
                    pending = None
                row["last"] = self.step == until
                progress.update(row)
                row.pop("last")
                writer.write(row)
                result.rows.append(row)
                try:
                    check_loss(row["loss"], self.step, cfg.max_loss, self.device)  # before this step is saved
                except DivergenceError:
                    if pending is not None:   # the last good checkpoint is complete before the run stops
                        self._finished(pending, result, progress, wait=True)
                    raise
                due = cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0
                if cfg.checkpoint_dir and (due or self.step == until):
                    if pending is not None:
                        self._finished(pending, result, progress, wait=True)
                    pending = self.begin_save()
                    if self._finished(pending, result, progress, wait=False):   # hashed already (small)
                        pending = None
            if pending is not None:
                self._finished(pending, result, progress, wait=True)
        finally:
            progress.close()
            writer.close()
            if self._clipper is not None:
                self._clipper.remove()
                self._clipper = None
        result.step = self.step
        return result

    @staticmethod
    def _finished(pending: checkpoint.PendingSave, result: TrainResult, progress: Progress, wait: bool) -> bool:
        """Complete a background save: ``wait`` for it, or only if every rank's hashing is done."""
        path = pending.finish() if wait else pending.poll()
        if path is None:
            return False
        result.checkpoints.append(str(path))
        progress.note(f"checkpoint step {pending.step} -> {path}")
        return True

    @property
    def _pipelined(self) -> bool:
        return bool(self.plan.pipeline and int(self.plan.pipeline.get("pp", 1)) > 1)


def train(cfg: TrainConfig, plan=None) -> TrainResult:
    """Build a Trainer and run it to ``cfg.steps`` (then write ``cfg.export_hf``): the Python form
    of ``autoplan train``."""
    trainer = Trainer(cfg, plan)
    result = trainer.fit()
    if cfg.export_hf:
        trainer.runner.export_hf(cfg.export_hf)
    return result
