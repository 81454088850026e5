"""Compare a parallelized model with its one-device reference: losses, gradients, a step (tests).

"Equals one device" means the same loss within rtol, every parameter gradient within rtol/atol
(DTensor gradients gathered to full tensors by :mod:`hyper_parallel.local.gather`, the same
gathering the demo and verify use), and the same after an optimizer step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hyper_parallel.local.gather import full, grads_by_name


@dataclass
class StepComparison:
    ref_losses: list[float] = field(default_factory=list)
    par_losses: list[float] = field(default_factory=list)
    grad_mismatches: list[str] = field(default_factory=list)
    missing_grads: list[str] = field(default_factory=list)
    losses_close: bool = True

    @property
    def ok(self) -> bool:
        return not self.grad_mismatches and not self.missing_grads and self.losses_close


def compare_steps(ref: nn.Module, par: nn.Module, batches: list[tuple], loss_fn: Callable,
                  par_loss_fn: Callable | None = None, lr: float = 1e-3, rtol_loss: float = 1e-5,
                  rtol_grad: float = 1e-4, atol_grad: float = 1e-6) -> StepComparison:
    """Train ``ref`` and ``par`` side by side with AdamW, one step per batch, comparing each."""
    par_loss_fn = par_loss_fn or loss_fn
    out = StepComparison()
    opt_r = torch.optim.AdamW(ref.parameters(), lr=lr)
    opt_p = torch.optim.AdamW(par.parameters(), lr=lr)
    for step, (inputs, target) in enumerate(batches):
        opt_r.zero_grad()
        opt_p.zero_grad()
        lr_ = loss_fn(ref(inputs), target)
        lr_.backward()
        lp = par_loss_fn(par, inputs, target)
        lr_v = float(lr_.detach())
        lp_v = float((full(lp) if isinstance(lp, DTensor) else lp).detach())
        out.ref_losses.append(lr_v)
        out.par_losses.append(lp_v)
        if abs(lr_v - lp_v) > rtol_loss * abs(lr_v) + 1e-7:
            out.losses_close = False
        g_ref, g_par = grads_by_name(ref), grads_by_name(par)
        for name, g in g_ref.items():
            if name not in g_par:
                out.missing_grads.append(f"step {step}: {name}")
                continue
            if not torch.allclose(g_par[name], g, rtol=rtol_grad, atol=atol_grad):
                err = (g_par[name] - g).abs().max().item()
                scale = g.abs().max().item()
                out.grad_mismatches.append(f"step {step}: {name} max abs err {err:.3g} (max |grad| {scale:.3g})")
        opt_r.step()
        opt_p.step()
    return out
