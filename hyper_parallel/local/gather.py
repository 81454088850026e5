"""Whole tensors from sharded ones, for comparing a parallel run with one device.

Why in the runtime: the demo, verify's numerics check and the tests all decide "equals one
device" by gathering DTensors (parameters, gradients, logits) to full tensors on every rank; one
definition keeps them comparing the same thing. Plain tensors pass through unchanged.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on this rank: a DTensor is gathered (a collective: every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def grads_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gradient of ``model`` by FQN, whole and detached (copies, so a later step
    or ``zero_grad`` does not change them)."""
    return {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
