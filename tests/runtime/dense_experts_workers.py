"""Rank function for tests/runtime/test_dense_experts.py."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hyper_parallel import parallelize_module
from hyper_parallel.core.expert_parallel import DenseExpertsParallel
from hyper_parallel.local import cached_mesh, full


class DenseExperts(nn.Module):
    """Llama-4's experts: every expert on its (pre-scaled) copy of every token."""

    def __init__(self, experts=4, hidden=8, ffn=12):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, hidden, 2 * ffn) * 0.3)
        self.down_proj = nn.Parameter(torch.randn(experts, ffn, hidden) * 0.3)
        self.act_fn = F.silu

    def forward(self, hidden_states):
        x = hidden_states.view(self.gate_up_proj.shape[0], -1, self.gate_up_proj.shape[1])
        gate, up = torch.bmm(x, self.gate_up_proj).chunk(2, dim=-1)
        return torch.bmm(up * self.act_fn(gate), self.down_proj).view(-1, self.down_proj.shape[-1])


def dense_experts_match_one_device() -> dict:
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    torch.manual_seed(0)
    ref = DenseExperts()
    par = parallelize_module(copy.deepcopy(ref), mesh, DenseExpertsParallel())
    x = torch.randn(4 * 6, 8)
    xr, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out_r, out_p = ref(xr), par(xp)
    (out_r * torch.arange(out_r.numel()).view_as(out_r)).sum().backward()
    (out_p * torch.arange(out_p.numel()).view_as(out_p)).sum().backward()
    return {"out": torch.allclose(out_r, out_p, rtol=1e-5, atol=1e-6),
            "input_grad": torch.allclose(xr.grad, xp.grad, rtol=1e-4, atol=1e-6),
            "grads": {n: torch.allclose(full(p.grad), dict(ref.named_parameters())[n].grad, rtol=1e-4, atol=1e-6)
                      for n, p in par.named_parameters()},
            "local_shapes": {n: tuple(p.to_local().shape) for n, p in par.named_parameters()}}
