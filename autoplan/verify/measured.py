"""Measured mode: run a plan on real ranks beside one device and compare with its predictions.

On every rank of a process group (gloo on CPU, nccl/hccl on accelerators: the device comes from
``hyper_parallel.platform``), :func:`measure_rank` builds the model twice from a factory, applies
the plan to one copy and checks numerics against the other (one device, whole global batch):
loss within ``rtol_loss`` and every parameter gradient within ``rtol_grad`` after one step. Then
it times ``steps`` training steps of the plan (AdamW, as the planner prices it), each fenced by a
barrier and taken as the slowest rank's, and records peak memory per rank: the device allocator's
peak on accelerators; on CPU, which has no allocator statistics, the exact bytes of parameters,
gradients and optimizer state held by this rank plus the peak of autograd's saved activations
(unique storages, recorded with saved-tensor hooks).

Entry points:

- :func:`measure` (plan, factory, ...) -> pandas DataFrame, one row per rank: inside a
  :class:`~hyper_parallel.local.RankPool` (``pool=``), or under torchrun (env:// init; every
  rank gets the same frame).
- ``python -m autoplan.verify.measured --plan plan.json --factory pkg.mod:fn --seq 32`` under
  ``torchrun --nproc-per-node N``: prints the frame on rank 0.

The factory must be importable (module level) and deterministic: called twice with the same
keyword arguments it returns two models with equal weights, on CPU (the rank moves them).
"""
from __future__ import annotations

import argparse
import importlib
import math
from dataclasses import astuple, dataclass
import statistics
import sys
import time
from typing import Any, Callable

import pandas as pd
import torch

from autoplan.plan import Plan
from autoplan.plan.forward import lm_loss, output_logits
from hyper_parallel.local import cached_mesh, grads_by_name
from hyper_parallel.platform import backend_for, device_module, device_type

COLUMNS = ("rank", "world", "ref_loss", "par_loss", "loss_rel_err", "loss_ok", "grads_checked", "grad_max_rel_err",
           "grad_mismatches", "numerics_ok", "steps", "measured_step_s", "predicted_step_s", "step_ratio",
           "measured_peak_bytes", "predicted_peak_bytes", "memory_ratio", "memory_source",
           "measured_static_bytes", "predicted_static_bytes", "measured_activation_bytes",
           "predicted_activation_bytes", "device", "backend")


def resolve_factory(factory: Callable | str) -> Callable:
    """A callable, or ``"package.module:function"`` (for torchrun command lines)."""
    if callable(factory):
        return factory
    mod, _, name = str(factory).partition(":")
    if not name:
        raise ValueError(f"measured: factory {factory!r} must be 'package.module:function'")
    return getattr(importlib.import_module(mod), name)


def _batch(global_batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _vocab(model: torch.nn.Module) -> int:
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return int(m.num_embeddings)
    raise ValueError("measured: the model has no nn.Embedding; pass vocab=")


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


class _SavedPeak:
    """Peak bytes of tensors autograd saves for backward (unique storages), via saved-tensor hooks."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def pack(self, t: torch.Tensor):
        from torch.distributed.tensor import DTensor

        local = t.to_local() if isinstance(t, DTensor) else t
        if isinstance(t, torch.nn.Parameter) or local.device.type == "meta":
            return (None, t)
        try:
            key = local.untyped_storage().data_ptr()
            nbytes = local.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return (None, t)
        if key not in self.live:
            self.live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self.refs[key] = self.refs.get(key, 0) + 1
        return (key, t)

    def unpack(self, packed):
        return packed[1]

    def reset_after_backward(self) -> None:
        self.live.clear()
        self.refs.clear()
        self.current = 0


def _accelerator_peak(device: str) -> int | None:
    mod = getattr(torch, device, None) if device != "cpu" else None
    if mod is not None and hasattr(mod, "max_memory_allocated"):
        return int(mod.max_memory_allocated())
    return None


def _numerics(plan, make, kwargs, mesh, device, global_batch, seq, vocab, seed, grad_tol: tuple[float, float]) -> dict:
    """One SGD step of the plan beside one device; ``grad_tol``: (rtol, atol) of each gradient."""
    import torch.distributed as dist

    ref = make(**kwargs).to(device)
    par = make(**kwargs).to(device)
    vocab = vocab or _vocab(ref)
    tokens, targets = (t.to(device) for t in _batch(global_batch, seq, vocab, seed))
    ref_loss = lm_loss(output_logits(ref(tokens)), targets)
    ref_loss.backward()
    g_ref = grads_by_name(ref)
    runner = plan.apply(par, mesh)
    runner.optimizer = torch.optim.SGD(par.parameters(), lr=0.0)
    local = runner.local_batch(tokens, targets)
    par_loss = torch.tensor(runner.step(local), dtype=torch.float64)
    if runner.dp_mesh is not None and runner.dp_mesh.size() > 1:
        par_loss = par_loss.to(device)
        dist.all_reduce(par_loss, group=runner.dp_mesh.get_group())
        par_loss = par_loss.cpu() / runner.dp_mesh.size()
    g_par = grads_by_name(par)
    rel_errs, bad = [], []
    for name, gr in g_ref.items():
        gp = g_par.get(name)
        if gp is None or gp.shape != gr.shape:
            bad.append(name)
            continue
        rel_errs.append(float((gp - gr).abs().max() / gr.abs().max().clamp_min(1e-30)))
        if not torch.allclose(gp, gr, rtol=grad_tol[0], atol=grad_tol[1]):
            bad.append(name)
    ref_loss = ref_loss.detach()
    loss_rel = abs(float(par_loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-30)
    return dict(ref_loss=float(ref_loss), par_loss=float(par_loss), loss_rel=loss_rel, rel_errs=rel_errs, bad=bad,
                vocab=vocab)


@dataclass(frozen=True)
class MeasureSettings:
    """How one measured run goes: the batch, the steps timed, the tolerances of the one-device check."""

    global_batch: int | None = None     # default: the plan's
    seq: int | None = None              # default: the plan's
    steps: int = 5
    warmup: int = 1
    vocab: int | None = None            # default: the model's
    rtol_loss: float = 1e-5
    rtol_grad: float = 1e-4
    atol_grad: float = 1e-6
    seed: int = 1234
    numerics: bool = True               # False: timing and memory only (numerics columns NaN)


def measure_rank(plan_json: str, factory: Callable | str, factory_kwargs: dict | None = None,
                 **settings: Any) -> dict[str, Any]:
    """Run on every rank of the default process group; returns this rank's row (see ``COLUMNS``).

    ``settings``: :class:`MeasureSettings`' fields (an unknown one is a TypeError)."""
    (global_batch, seq, steps, warmup, vocab, rtol_loss, rtol_grad, atol_grad, seed,
     numerics) = astuple(MeasureSettings(**settings))
    import torch.distributed as dist

    plan = Plan.from_json(plan_json) if isinstance(plan_json, str) else plan_json
    make = resolve_factory(factory)
    kwargs = dict(factory_kwargs or {})
    dev = device_type()
    rank, world = dist.get_rank(), dist.get_world_size()
    want = math.prod(plan.mesh["shape"])
    if want != world:
        raise ValueError(f"measured: the plan's mesh {plan.mesh['shape']} needs {want} ranks, this group has {world}")
    global_batch = int(global_batch or plan.batch.get("global_batch") or 1)
    seq = int(seq or plan.batch.get("seq_len") or 16)
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    mod = getattr(torch, dev, None) if dev != "cpu" else None
    device = torch.device(dev, torch.accelerator.current_device_index()) if dev != "cpu" else torch.device("cpu")

    # ---- numerics: one SGD step of the plan vs one device on the whole batch
    if numerics:
        num = _numerics(plan, make, kwargs, mesh, device, global_batch, seq, vocab, seed, (rtol_grad, atol_grad))
    else:
        num = dict(ref_loss=float("nan"), par_loss=float("nan"), loss_rel=float("nan"), rel_errs=[], bad=[])
    vocab = vocab or num.get("vocab") or _vocab(make(**kwargs))
    tokens, targets = (t.to(device) for t in _batch(global_batch, seq, vocab, seed))
    ref_loss, par_loss, loss_rel, rel_errs, bad = (num[k] for k in ("ref_loss", "par_loss", "loss_rel", "rel_errs", "bad"))

    # ---- timing and memory: AdamW steps of the plan on a fresh copy
    par = make(**kwargs).to(device)
    runner = plan.apply(par, mesh)
    if mod is not None and hasattr(mod, "reset_peak_memory_stats"):
        mod.synchronize()
        mod.reset_peak_memory_stats()
    saved = _SavedPeak()
    times = []
    local = runner.local_batch(tokens, targets)
    for i in range(warmup + steps):
        if mod is not None:
            mod.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            runner.step(local)
        if mod is not None:
            mod.synchronize()
        dt = time.perf_counter() - t0
        saved.reset_after_backward()
        if i >= warmup:
            times.append(dt)
    slow = torch.tensor(times, dtype=torch.float64, device=device if dev != "cpu" else "cpu")
    dist.all_reduce(slow, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
    measured_step = statistics.median(slow.cpu().tolist())
    static = sum(_local_bytes(p) for p in par.parameters()) + sum(_local_bytes(p.grad) for p in par.parameters())
    for state in runner.optimizer.state.values():
        static += sum(_local_bytes(v) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
    acc_peak = _accelerator_peak(dev)
    peak = acc_peak if acc_peak is not None else static + saved.peak
    pred = plan.predictions
    pmem = pred.get("memory_bytes", {})
    p_static = float(sum(v for k, v in pmem.items() if k in ("params", "grads", "optimizer")))
    p_total = float(pmem.get("total", sum(v for k, v in pmem.items() if k != "total")))
    p_step = float(pred.get("step_s", float("nan")))
    loss_ok = bool(loss_rel <= rtol_loss) if numerics else None
    return {
        "rank": rank, "world": world, "ref_loss": float(ref_loss), "par_loss": float(par_loss),
        "loss_rel_err": loss_rel, "loss_ok": loss_ok, "grads_checked": len(rel_errs) + len(bad),
        "grad_max_rel_err": max(rel_errs, default=0.0), "grad_mismatches": ",".join(bad[:5]),
        "numerics_ok": (loss_ok and not bad) if numerics else None, "steps": steps, "measured_step_s": measured_step,
        "predicted_step_s": p_step, "step_ratio": measured_step / p_step if p_step > 0 else float("nan"),
        "measured_peak_bytes": int(peak), "predicted_peak_bytes": p_total,
        "memory_ratio": peak / p_total if p_total > 0 else float("nan"),
        "memory_source": "allocator_peak" if acc_peak is not None else "state+saved_activations",
        "measured_static_bytes": int(static), "predicted_static_bytes": p_static,
        "measured_activation_bytes": int(saved.peak), "predicted_activation_bytes": float(pmem.get("activations", 0.0)),
        "device": dev, "backend": backend_for(dev),
    }


def measure(plan, factory: Callable | str, factory_kwargs: dict | None = None, *, pool=None,
            global_batch: int | None = None, seq: int | None = None, steps: int = 5, warmup: int = 1,
            **kw) -> pd.DataFrame:
    """Measure ``plan`` on real ranks: one row per rank (numerics, step time, peak memory vs predicted).

    With ``pool`` (a RankPool of the plan's world size) the ranks are the pool's; otherwise the
    default process group must be initialised (torchrun, env://) and this call is collective.
    """
    import torch.distributed as dist

    plan_json = plan if isinstance(plan, str) else plan.to_json()
    args = dict(global_batch=global_batch, seq=seq, steps=steps, warmup=warmup, **kw)
    if pool is not None:
        rows = pool.run(measure_rank, plan_json, factory, factory_kwargs, **args)
    else:
        if not dist.is_initialized():
            raise RuntimeError("measured: no process group; pass pool= or run under torchrun")
        row = measure_rank(plan_json, factory, factory_kwargs, **args)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def summarize(frame: pd.DataFrame) -> dict[str, Any]:
    """One line per plan: numerics pass, step time and worst-rank peak memory vs predicted."""
    return {"world": int(frame["world"].iloc[0]), "numerics_ok": bool(frame["numerics_ok"].all()),
            "loss_rel_err": float(frame["loss_rel_err"].max()), "grad_max_rel_err": float(frame["grad_max_rel_err"].max()),
            "measured_step_s": float(frame["measured_step_s"].iloc[0]),
            "predicted_step_s": float(frame["predicted_step_s"].iloc[0]),
            "measured_peak_bytes": int(frame["measured_peak_bytes"].max()),
            "predicted_peak_bytes": float(frame["predicted_peak_bytes"].iloc[0])}


def main(argv: list[str] | None = None) -> int:
    """``torchrun --nproc-per-node N -m autoplan.verify.measured --plan P --factory mod:fn``."""
    import datetime
    import json

    import torch.distributed as dist

    ap = argparse.ArgumentParser(prog="autoplan-measured", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True, help="plan JSON file")
    ap.add_argument("--factory", required=True, help="package.module:function returning the model")
    ap.add_argument("--factory-kwargs", default="{}", help="JSON keyword arguments for the factory")
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", help="CSV of the per-rank rows (rank 0 writes)")
    args = ap.parse_args(argv)
    dev = device_type()
    if dev != "cpu":
        import os

        device_module(dev).set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend_for(dev), init_method="env://", timeout=datetime.timedelta(seconds=300))
    try:
        with open(args.plan) as f:
            plan_json = f.read()
        frame = measure(plan_json, args.factory, json.loads(args.factory_kwargs), global_batch=args.global_batch,
                        seq=args.seq, steps=args.steps)
        if dist.get_rank() == 0:
            with pd.option_context("display.width", 200, "display.max_columns", 40):
                print(frame.to_string(index=False))
            if args.out:
                frame.to_csv(args.out, index=False)
        ok = bool(frame["numerics_ok"].all())
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
