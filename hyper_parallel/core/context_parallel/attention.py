"""The context-parallel attention kernel: one callable per (cp mesh, variant), shared by every hook.

``CPAttention(mesh, variant)(q, k, v, scale)`` takes this rank's load-balanced shard of q, k, v
in (batch, heads, local seq, head_dim) -- k and v with their own (grouped-query) head count --
and returns the causal attention output for the local queries, (batch, heads, local seq, head_dim).
The repo Llama's ``attention_kernel`` hook and the transformers attention function both call it.
"""
from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.core.context_parallel.allgather import allgather_attention
from hyper_parallel.core.context_parallel.layout import group_rank_size
from hyper_parallel.core.context_parallel.ring import ring_attention
from hyper_parallel.errors import LayoutError, StyleSpecError

VARIANTS = {"ring": ring_attention, "allgather": allgather_attention}


def check_variant(variant, where: str) -> str:
    if variant not in VARIANTS:
        raise StyleSpecError(f"{where}: variant={variant!r} is not one of {sorted(VARIANTS)}")
    return variant


class CPAttention:
    """Causal attention over the cp ring of ``mesh`` (a 1-D mesh) by ``variant``."""

    def __init__(self, mesh: DeviceMesh, variant: str = "ring"):
        self.variant = check_variant(variant, "CPAttention")
        self.mesh = mesh
        self.group, self.rank, self.size = group_rank_size(mesh)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        if q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[0] != k.shape[0] or \
                q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
            raise LayoutError(
                f"context parallel attention: expected q (b, h, s, d) and k, v (b, hk, s, d) with hk dividing h, got "
                f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        return VARIANTS[self.variant](q, k, v, self.group, self.rank, self.size, scale)

    def __repr__(self) -> str:
        return f"CPAttention(variant={self.variant!r}, cp={self.size})"
