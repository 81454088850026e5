"""A plan compiled trains as the same plan in eager: the check, on local gloo ranks.

Every rank builds the small copy once per setting from the same recipe, applies the plan with
``compile=`` each setting (eager first), runs a few AdamW steps on the same batches and keeps the
losses, its parameters (whole) and dynamo's graph and graph-break counts. Compared with eager:
the loss of every step (relative difference) and the parameters after the last step (mean
absolute difference). A run with ``one_device=True`` also trains the copy on one process, so an
inductor run can be compared with the one-device model (inductor's fused kernels round
differently from eager, so it is compared at a looser tolerance than aot_eager, which runs
eager's own kernels).
"""
from __future__ import annotations

import logging
import math
import traceback
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from autoplan.plan.forward import forward_tokens, lm_loss, output_logits
from autoplan.plan.plan import Plan
from autoplan.verify.numerics import _vocab, small_plan
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.local import RankPool, cached_mesh

log = logging.getLogger(__name__)
COMPILE_TIMEOUT_S = 1200.0   # a setting's compile takes minutes on a loaded 2-core CPU


def _whole_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def _mean_abs(a: dict, b: dict) -> float:
    names = [n for n in a if n in b and a[n].shape == b[n].shape]
    if not names or len(names) != len(a):
        return math.inf
    return float(sum((a[n].double() - b[n].double()).abs().mean() for n in names) / len(names))


def compiled_rank(plan_json: str, recipe: ModelRecipe, global_batch: int, seq: int, specs: list,
                  steps: int = 3, one_device: bool = False, seed: int = 11) -> dict:
    """On every rank: the plan in eager, then under each compile setting of ``specs``."""
    plan = Plan.from_json(plan_json)
    probe = recipe.build()
    vocab = _vocab(probe)
    g = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(0, vocab, (global_batch, seq), generator=g),
                torch.randint(0, vocab, (global_batch, seq), generator=g)) for _ in range(steps)]
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    out: dict = {}
    for spec in [None] + list(specs):
        name = "eager" if spec is None else f"{spec['mode']}/{spec['backend']}"
        try:
            par = recipe.build()
            runner = small_plan(plan, par).apply(par, mesh, compile=spec)
            losses = [runner.step(runner.local_batch(x, y)) for x, y in batches]
            out[name] = {"losses": losses, "params": _whole_params(par), "stats": runner.compiled.stats(),
                         "error": None}
        except Exception as exc:  # noqa: BLE001 - each setting reports its own failure
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:600], "trace": traceback.format_exc()[-3000:]}
        torch._dynamo.reset()
    if one_device:
        ref = recipe.build()
        opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        losses = []
        for x, y in batches:
            opt.zero_grad()
            loss = lm_loss(output_logits(forward_tokens(ref, x)), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        out["one_device"] = {"losses": losses, "params": _whole_params(ref), "stats": {}, "error": None}
    eager = out["eager"]
    report = {}
    for name, r in out.items():
        if r["error"] is not None or name == "eager" or eager["error"] is not None:
            report[name] = {"error": r["error"] or (eager["error"] and f"eager: {eager['error']}"),
                            "trace": r.get("trace", "")}
            continue
        base = eager
        loss_rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], base["losses"]))
        report[name] = {"error": None, "loss_rel": loss_rel, "param_mean_abs": _mean_abs(base["params"], r["params"]),
                        "stats": r["stats"]}
        if one_device and name != "one_device":   # every parameter this rank holds, against one device's
            ref = out["one_device"]["params"]
            report[name]["one_device_loss_rel"] = max(abs(a - b) / abs(b) for a, b in
                                                      zip(r["losses"], out["one_device"]["losses"]))
            report[name]["one_device_off"] = [n for n, p in r["params"].items() if n not in ref or not
                                              torch.allclose(p, ref[n], rtol=1e-4, atol=1e-6)]
    if eager["error"] is not None:
        report["eager"] = {"error": eager["error"], "trace": eager.get("trace", "")}
    return report


@dataclass
class CompiledResult:
    """Per setting: worst loss difference over ranks and steps, worst mean parameter difference,
    graphs and graph breaks (rank 0), or the first rank's error."""
    settings: dict = field(default_factory=dict)
    error: str | None = None


def check_compiled(plan: Plan, recipe: ModelRecipe, specs: list, *, pool: RankPool, global_batch: int | None = None,
                   seq: int = 16, steps: int = 3, one_device: bool = False) -> CompiledResult:
    """Run :func:`compiled_rank` on ``pool`` (the plan's world size); a failure of the run itself
    (a hang cut by the pool's timeout, a rank's crash outside a setting) is the result's error."""
    dp = int(dict(zip(plan.mesh["names"], plan.mesh["shape"])).get(plan.dp_dim, 1)) if plan.dp_dim else 1
    global_batch = global_batch or 2 * dp
    timeout, pool.timeout_s = pool.timeout_s, max(pool.timeout_s, COMPILE_TIMEOUT_S)   # compiling is slow here
    try:
        results = pool.run(compiled_rank, plan.to_json(), recipe, global_batch, seq, specs, steps, one_device)
    except Exception as exc:  # noqa: BLE001 - a failing plan is a result
        return CompiledResult(error="".join(traceback.format_exception_only(type(exc), exc))[-2000:])
    finally:
        pool.timeout_s = timeout
    merged: dict = {}
    for name in results[0]:
        rows = [r[name] for r in results]
        err = next((r["error"] for r in rows if r["error"]), None)
        if err:
            merged[name] = {"error": err, "trace": next(r.get("trace", "") for r in rows if r["error"])}
            continue
        if "loss_rel" not in rows[0]:   # eager itself: the baseline
            merged[name] = rows[0]
            continue
        merged[name] = {"error": None, "loss_rel": max(r["loss_rel"] for r in rows),
                        "param_mean_abs": max(r["param_mean_abs"] for r in rows), "stats": rows[0]["stats"]}
        if "one_device_off" in rows[0]:
            merged[name]["one_device_loss_rel"] = max(r["one_device_loss_rel"] for r in rows)
            merged[name]["one_device_off"] = sorted({n for r in rows for n in r["one_device_off"]})
    return CompiledResult(settings=merged)
