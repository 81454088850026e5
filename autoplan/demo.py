"""The demo behind ``autoplan demo``: plan a small Llama for 4 CPU ranks, apply, train, compare.

autoplan plans the model for a ``world``-rank tensor-parallel mesh on this host's measured CPU
profile; the plan (or a named expert plan) is applied with hyper_parallel on gloo ranks, a few
steps are trained beside a one-device copy, and the losses and the predicted vs measured step
times come back, so a person sees the plan and that the parallel run computes the same numbers.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoplan.api import autoplan
from autoplan.models import build_llama
from autoplan.models.llama_plans import EXPERT_PLANS
from hyper_parallel.parallel_dims import ParallelDims
from cost_models.runtime import calibrate_runtime, load_runtime
from autoplan.parallelisms.tensor import runner_styles
from hyper_parallel import loss_parallel, parallelize_module
from hyper_parallel.local import RankPool, cached_mesh, full

log = logging.getLogger(__name__)
DEMO_MODEL = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_hidden=384, max_seq_len=64)


@dataclass
class DemoResult:
    plan: pd.DataFrame
    steps: pd.DataFrame
    world: int
    predicted_step_s: float | None
    notes: list[str]

    @property
    def max_rel_diff(self) -> float:
        d = (self.steps["parallel_loss"] - self.steps["one_device_loss"]).abs() / self.steps["one_device_loss"].abs()
        return float(d.max())

    @property
    def measured_step_s(self) -> float:
        times = list(self.steps["parallel_s"])
        return statistics.median(times[1:] if len(times) > 1 else times)


def _batches(steps: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(steps)]


def _rank_main(styles: dict, steps: int, batch: int, seq: int):
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    ref = build_llama(seed=0, **DEMO_MODEL)
    par = build_llama(seed=0, **DEMO_MODEL)
    parallelize_module(par, mesh, runner_styles(styles), strict=True)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_p = torch.optim.AdamW(par.parameters(), lr=1e-3)
    rows = []
    for step, data in enumerate(_batches(steps, batch, seq, DEMO_MODEL["vocab_size"])):
        tokens, target = data[:, :-1], data[:, 1:]
        opt_r.zero_grad()
        t0 = time.perf_counter()
        loss_r = F.cross_entropy(ref(tokens).flatten(0, 1), target.flatten())
        loss_r.backward()
        opt_r.step()
        t1 = time.perf_counter()
        dist.barrier()
        t1b = time.perf_counter()
        opt_p.zero_grad()
        logits = par(tokens)
        with loss_parallel():
            loss_p = F.cross_entropy(logits.flatten(0, 1), target.flatten())
            loss_p.backward()
        opt_p.step()
        dist.barrier()
        t2 = time.perf_counter()
        rows.append({"step": step, "one_device_loss": float(loss_r.detach()),
                     "parallel_loss": float(full(loss_p).detach()),
                     "one_device_s": t1 - t0, "parallel_s": t2 - t1b})
    return rows


def _ensure_runtime_calibration(world: int, pool) -> None:
    """The cpu profile's predictions need this host's eager-rank overheads (DTensor dispatch,
    gloo collectives); measure them once on the demo's own ranks (~15 s) if none are cached."""
    if load_runtime(world) is None:
        log.warning("demo: calibrating this host's runtime overheads on %d ranks (once, cached)", world)
        calibrate_runtime(world, pool=pool)


def plan_demo_model(world: int, batch: int, seq: int):
    """autoplan for the demo model on a ``world``-rank tp mesh priced with this host's CPU profile.

    The demo model is far too small for tensor parallelism to pay (the planner says so), so the
    demo asks for every unit to be sharded to show a real plan being applied.
    """
    model = build_llama(device="meta", **DEMO_MODEL)
    return autoplan(model, ParallelDims((world,), ("tp",), "cpu"), batch=(batch, seq), dtype=torch.float32,
                    allow_replicated_units=False)


def run_demo(world: int = 4, plan_name: str = "auto", steps: int = 5, batch: int = 4, seq: int = 32) -> DemoResult:
    """Plan (``auto``) or take a named expert plan, then train on ``world`` gloo ranks."""
    if plan_name != "auto" and plan_name not in EXPERT_PLANS:
        raise ValueError(f"demo: unknown plan {plan_name!r}; use 'auto' or one of {sorted(EXPERT_PLANS)}")
    with RankPool(world, timeout_s=600) as pool:
        if plan_name == "auto":
            _ensure_runtime_calibration(world, pool)
            plan = plan_demo_model(world, batch, seq)
            styles, predicted, notes = plan.styles, plan.step_time, list(plan.notes)
            table = plan.summary()[["unit", "count", "strategy", "stream", "compute_s", "comm_s", "reason"]]
        else:
            styles = {k: v.to_dict() for k, v in EXPERT_PLANS[plan_name]().items()}
            predicted, notes = None, []
            table = pd.DataFrame([{"module": k, "style": v["style"], "args": v["args"]} for k, v in styles.items()])
        per_rank = pool.run(_rank_main, styles, steps, batch, seq)
    if plan_name == "auto":
        table.attrs["styles"] = styles
    return DemoResult(plan=table, steps=pd.DataFrame(per_rank[0]), world=world, predicted_step_s=predicted,
                      notes=notes)
