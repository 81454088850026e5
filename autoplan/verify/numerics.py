"""Numerics of a plan: one training step of its styles on a small copy of the model, on local
gloo ranks, against one device.

A dry run proves the collectives a plan issues; only numbers prove that it trains right. A
gradient that is never all-reduced (a norm on head-sharded activations), a reshape by the
global head count, a loss computed on a shard: each can leave the loss equal and a gradient
wrong. So every rank builds the small copy twice from the same :class:`ModelRecipe`, applies the
plan to one and steps both (SGD, so that "parameters after the step agree" inherits the
gradients' tolerance), and compares the loss, every gradient and every parameter after the step.

The plan's styles are applied as written, except patterns that name blocks the small copy does
not have (it keeps :data:`~autoplan.verify.shrink.LAYERS` blocks per stack).
"""
from __future__ import annotations

import logging
import math
import traceback
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from autoplan.plan.plan import Plan
from autoplan.plan.forward import forward_tokens, lm_loss, output_logits
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.core.tensor_parallel import match_modules
from hyper_parallel.local import RankPool, cached_mesh, grads_by_name

log = logging.getLogger(__name__)

RTOL_LOSS = 1e-5
RTOL_GRAD = 1e-4
ATOL_GRAD = 1e-6


@dataclass
class NumericsResult:
    """Outcome of one numerics check; ``error`` holds the traceback of a run that failed."""

    passed: bool
    ref_loss: float = float("nan")
    par_loss: float = float("nan")
    bad_grads: list[str] = field(default_factory=list)
    bad_params: list[str] = field(default_factory=list)
    n_grads: int = 0
    error: str | None = None

    def summary(self) -> str:
        if self.error:
            return f"error: {self.error.strip().splitlines()[-1]}"
        if self.passed:
            return f"equal to one device (loss {self.par_loss:.6g}, {self.n_grads} gradients)"
        return (f"differs from one device: loss {self.par_loss:.6g} vs {self.ref_loss:.6g}; "
                f"gradients {self.bad_grads[:3]}; parameters {self.bad_params[:3]}")


def small_plan(plan: Plan, model: torch.nn.Module) -> Plan:
    """``plan`` with the style patterns that match nothing in ``model`` dropped."""
    styles = {k: v for k, v in plan.styles.items() if match_modules(model, k)}
    return plan.replace(styles=styles)


def numerics_rank(plan_json: str, recipe: ModelRecipe, global_batch: int, seq: int, lr: float = 0.1,
                  seed: int = 11) -> dict:
    """On every rank of the current process group: plan vs one device for one SGD step."""
    import torch.distributed as dist

    plan = Plan.from_json(plan_json)
    ref, par = recipe.build(), recipe.build()
    vocab = _vocab(ref)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (global_batch, seq), generator=g)
    targets = torch.randint(0, vocab, (global_batch, seq), generator=g)
    ref_loss = lm_loss(output_logits(forward_tokens(ref, tokens)), targets)
    ref_loss.backward()
    g_ref = grads_by_name(ref)
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    runner = small_plan(plan, par).apply(par, mesh)
    runner.optimizer = torch.optim.SGD(par.parameters(), lr=lr)
    loss = torch.tensor(runner.step(runner.local_batch(tokens, targets)), dtype=torch.float64)
    if runner.dp_mesh is not None and runner.dp_mesh.size() > 1:
        dist.all_reduce(loss, group=runner.dp_mesh.get_group())
        loss /= runner.dp_mesh.size()
    g_par = grads_by_name(par)
    # a pipeline rank holds only its stages: what it lacks is checked on the rank that holds it
    # (check_numerics requires every name held somewhere); any other plan holds every parameter
    staged = int((plan.pipeline or {}).get("pp", 1)) > 1
    held = [n for n in g_ref if n in g_par] if staged else list(g_ref)
    bad = [n for n in held
           if n not in g_par or g_par[n].shape != g_ref[n].shape or not torch.allclose(g_par[n], g_ref[n], rtol=RTOL_GRAD,
                                                                                      atol=ATOL_GRAD)]
    if bad and all(n in g_par and g_par[n].shape == g_ref[n].shape for n in bad):
        bad = _beyond_float_noise(bad, g_ref, g_par, recipe, tokens, targets)
    # a gradient left a partial sum (or in other placements than its parameter) can still gather
    # to the right values here while the optimizer, a clipping hook or FSDP reads its local shard
    bad += [f"{n} (gradient placements {tuple(p.grad.placements)}, parameter {tuple(p.placements)})"
            for n, p in par.named_parameters()
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements]
    p_ref = {n: p.detach() for n, p in ref.named_parameters()}
    p_par = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in par.named_parameters()}
    bad_params = [n for n in (held if staged else p_ref)
                  if n not in p_par or p_par[n].shape != p_ref[n].shape
                  or not torch.allclose(p_par[n], p_ref[n], rtol=RTOL_GRAD, atol=ATOL_GRAD)]
    return {"ref": float(ref_loss.detach()), "par": float(loss), "bad_grads": bad, "bad_params": bad_params,
            "n_grads": len(g_ref), "held": held, "all": list(g_ref)}


def _beyond_float_noise(names: list[str], g_ref: dict, g_par: dict, recipe: ModelRecipe, tokens, targets) -> list[str]:
    """The gradients among ``names`` that differ from one device by more than float32 rounding.

    A gradient summed over many positions (an embedding's: Nemotron's reach 1.3) carries rounding
    of a few 1e-6 in one device's own float32 result, beyond ATOL_GRAD near zero. Each is judged
    against a float64 run of the same step: the plan's gradient is wrong only if it lies farther
    from float64 than twice one device's float32 error (plus ATOL_GRAD). A real fault (a missing
    reduction, a shard summed twice) is off by the gradient's own magnitude, far beyond that."""
    try:
        exact = recipe.build().double()
        lm_loss(output_logits(forward_tokens(exact, tokens)), targets).backward()
    except (RuntimeError, TypeError, NotImplementedError) as exc:   # a kernel without float64 (grouped_mm)
        log.info("no float64 run to judge rounding against (%s): every difference counts", exc)
        return list(names)
    g64 = grads_by_name(exact)
    out = []
    for n in names:
        want = g64.get(n)
        if want is None:
            out.append(n)
            continue
        noise = float((g_ref[n].double() - want).abs().max())
        if float((g_par[n].double() - want).abs().max()) > 2 * noise + ATOL_GRAD:
            out.append(n)
        else:
            log.info("%s: differs from one device by float32 rounding only (one device's own error vs float64 %.3g)",
                     n, noise)
    return out


def _vocab(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    if callable(getattr(config, "get_text_config", None)):   # a composite (VL) config: its language model's
        config = config.get_text_config()
    if config is not None and getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    return next(int(m.num_embeddings) for m in model.modules() if isinstance(m, torch.nn.Embedding))


def check_numerics(plan: Plan, recipe: ModelRecipe, *, pool=None, global_batch: int | None = None,
                   seq: int = 16) -> NumericsResult:
    """Run :func:`numerics_rank` on ``pool`` (a RankPool of the plan's world size; one is started
    and closed when None). Any failure -- a runtime error on a rank, a hang cut by the pool's
    timeout -- is a failed result carrying the error, never an exception."""
    world = math.prod(plan.mesh["shape"])
    dp = int(dict(zip(plan.mesh["names"], plan.mesh["shape"])).get(plan.dp_dim, 1)) if plan.dp_dim else 1
    global_batch = global_batch or 2 * dp
    own = pool is None
    try:
        if own:
            pool = RankPool(world)
        if pool.world != world:
            return NumericsResult(False, error=f"ValueError: pool of {pool.world} ranks for a plan of world {world}")
        results = pool.run(numerics_rank, plan.to_json(), recipe, global_batch, seq)
    except Exception as exc:  # noqa: BLE001 - a failing plan is a result, not a crash of verify
        return NumericsResult(False, error="".join(traceback.format_exception_only(type(exc), exc))[-4000:])
    finally:
        if own and pool is not None:
            pool.close()
    r0 = results[0]
    nowhere = set(r0["all"]).difference(*(r["held"] for r in results))   # a gradient no rank holds
    bad_g = sorted({n for r in results for n in r["bad_grads"]} | nowhere)
    bad_p = sorted({n for r in results for n in r["bad_params"]})
    loss_ok = all(abs(r["par"] - r["ref"]) <= RTOL_LOSS * abs(r["ref"]) for r in results)
    return NumericsResult(loss_ok and not bad_g and not bad_p, r0["ref"], r0["par"], bad_g, bad_p, r0["n_grads"])
