"""Rank function for tests/planner/test_latent_attention.py: the bytes one latent attention module
saves for backward, on this rank of a heads-sharded plan and on one device."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from autoplan.plan import Plan
from autoplan.verify.numerics import small_plan
from hyper_parallel.local import cached_mesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _Saved:
    """Unique storages autograd saves while ``module`` runs (its local shards for DTensors)."""

    def __init__(self, module: torch.nn.Module):
        # weights autograd keeps (as transposed views) are parameters, not activations
        self.bytes, self.ctx = 0, None
        self.seen = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
        module.register_forward_pre_hook(self.enter)
        module.register_forward_hook(self.leave)

    def pack(self, t):
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return t

    def enter(self, *_):
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.ctx.__enter__()

    def leave(self, *_):
        self.ctx.__exit__(None, None, None)


def attention_saved_bytes(plan_json: str, recipe, attention: str, batch: tuple[int, int]) -> tuple[int, int]:
    """(bytes saved by ``attention`` on this rank under the plan, bytes it saves on one device)."""
    plan = Plan.from_json(plan_json)
    ref, par = recipe.build(), recipe.build()
    tokens = torch.randint(0, 64, batch, generator=torch.Generator().manual_seed(5))
    mesh = cached_mesh(tuple(plan.mesh["shape"]), tuple(plan.mesh["names"]))
    small_plan(plan, par).apply(par, mesh)
    counters = [_Saved(ref.get_submodule(attention)), _Saved(par.get_submodule(attention))]
    for model in (par, ref):
        model(tokens)
    return counters[1].bytes, counters[0].bytes
