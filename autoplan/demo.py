"""The demo behind ``autoplan demo``: a tensor-parallel Llama on 4 CPU ranks equals one device.

Starts ``world`` gloo ranks, applies a plan to a small Llama with hyper_parallel, trains a few
steps beside a one-device copy on every rank, and returns per-step losses of both, so a person
sees the plan and that the parallel run computes the same numbers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autoplan.models import build_llama
from autoplan.models.llama_plans import EXPERT_PLANS
from hyper_parallel import loss_parallel, parallelize_module
from hyper_parallel.testing import RankPool, cached_mesh
from hyper_parallel.testing.compare import full

DEMO_MODEL = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_hidden=384, max_seq_len=64)


@dataclass
class DemoResult:
    plan: pd.DataFrame
    steps: pd.DataFrame
    world: int

    @property
    def max_rel_diff(self) -> float:
        d = (self.steps["parallel_loss"] - self.steps["one_device_loss"]).abs() / self.steps["one_device_loss"].abs()
        return float(d.max())


def _batches(steps: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(steps)]


def _rank_main(plan_name: str, steps: int, batch: int, seq: int):
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    ref = build_llama(seed=0, **DEMO_MODEL)
    par = build_llama(seed=0, **DEMO_MODEL)
    plan = EXPERT_PLANS[plan_name]()
    parallelize_module(par, mesh, plan)
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
                     "one_device_s": t1 - t0, "parallel_s": t2 - t1})
    return rows


def run_demo(world: int = 4, plan_name: str = "torchtitan", steps: int = 5, batch: int = 4,
             seq: int = 32) -> DemoResult:
    """Run the demo on ``world`` gloo ranks; returns the plan table and per-step losses."""
    plan = EXPERT_PLANS[plan_name]()
    plan_df = pd.DataFrame(
        [{"module": k, "style": v.to_dict()["style"], "args": v.to_dict()["args"]} for k, v in plan.items()]
    )
    with RankPool(world, timeout_s=600) as pool:
        per_rank = pool.run(_rank_main, plan_name, steps, batch, seq)
    return DemoResult(plan=plan_df, steps=pd.DataFrame(per_rank[0]), world=world)
