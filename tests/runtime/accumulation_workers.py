"""Rank functions for tests/runtime/test_accumulation.py: one-stage plans with m > 1 micro-batches
(gradient accumulation in ``Runner.forward_backward``) against one device, and a batch the
micro-batches do not divide failing on every rank before any collective."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autoplan.plan import Plan
from autoplan.verify.numerics import numerics_rank
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.errors import MicrobatchError
from hyper_parallel.local import cached_mesh
from tests.planner.modes_workers import run_zero1_case


def recipe(name: str) -> ModelRecipe:
    """Every rank's copy of the e2e model ``name``, every parameter perturbed (ModelRecipe.build)."""
    return ModelRecipe(factory="tests.planner.e2e_workers:build", kwargs={"name": name}, seed=3)


def undivided_batch(plan_json: str, name: str, rows: int) -> dict:
    """Step a local batch of ``rows`` rows that the plan's micro-batches do not divide: the typed
    error must come before any forward (no collective issued, so the group still works); then
    ``rows + 1`` rows step as one forward per micro-batch (returns the rows each forward saw)."""
    plan = Plan.from_json(plan_json)
    model = recipe(name).build()
    runner = plan.apply(model, cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"])))
    tokens = torch.zeros(rows, 16, dtype=torch.long)
    try:
        runner.step((tokens, tokens))
        error = None
    except MicrobatchError as exc:
        error = str(exc)
    grads = sum(p.grad is not None for p in model.parameters())
    ok = torch.ones(1)
    dist.all_reduce(ok)   # every rank is still in step: the group answers
    passes = []
    hook = model.register_forward_pre_hook(lambda module, args: passes.append(args[0].shape[0]))
    rows = rows + 1   # now divisible: one forward of rows / m per micro-batch
    runner.step((tokens.new_zeros(rows, 16), tokens.new_zeros(rows, 16)))
    hook.remove()
    return {"error": error, "grads": grads, "world": float(ok), "passes": passes}


def run_cases(cases: list[tuple[str, str, str, int]], bad: tuple[str, str, int]) -> dict:
    """{label: numerics_rank result} for (label, plan JSON, model name, global batch) cases (ZeRO-1
    plans: ``run_zero1_case``, which checks this rank's reduced gradient slice -- ZeRO-1 leaves whole
    averaged gradients on no rank -- on an e2e model whose every parameter is drawn anew), and
    ``"undivided"``: :func:`undivided_batch` on ``bad`` = (plan JSON, model name, local rows)."""
    out = {label: run_zero1_case(plan_json, name, batch=gb) if Plan.from_json(plan_json).fsdp.get("mode") == "zero1"
           else numerics_rank(plan_json, recipe(name), gb, 16) for label, plan_json, name, gb in cases}
    out["undivided"] = undivided_batch(*bad)
    return out
