"""Rank functions for tests/runtime/test_torch_parity.py: one module parallelized by our style
and by torch's (same arguments), run on the same inputs; outputs, every gradient, the gradients'
placements and the collectives of forward and backward (CommDebugMode) are reported."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as tp
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import hyper_parallel as hp
from autoplan.models.llama import RMSNorm
from hyper_parallel.local import cached_mesh, full
from hyper_parallel.testing.comm_counts import count_collectives

D = 8


class KwOnly(nn.Module):
    """``y`` is keyword-only: torch's own test module for kwarg layouts."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x, *, y):
        return self.linear(x) + y


class KwOrPositional(nn.Module):
    """``y`` may be positional but is passed as a keyword (how HF passes hidden states)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x, y):
        return self.linear(x) * y


def _prepare_args(both: bool) -> dict:
    args = dict(input_layouts=Shard(0), desired_input_layouts=Replicate(),
                input_kwarg_layouts={"y": Shard(0)}, desired_input_kwarg_layouts={"y": Replicate()})
    if both:
        args.update(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    return args


def _inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard of x and y
    return (torch.randn(2, D, generator=g, requires_grad=True),
            torch.randn(2, D, generator=g, requires_grad=True))


def _report(model, run) -> dict:
    holder = {}

    def step():
        out = holder["out"] = run(model)
        out.backward(torch.ones_like(out))

    totals, per = count_collectives(model, step)  # gathers for the comparison come after, uncounted
    out = holder["out"]
    return {
        "out": (full(out) if isinstance(out, DTensor) else out).detach(),
        "grads": {n: full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        "grad_placements": {n: tuple(map(str, p.grad.placements)) for n, p in model.named_parameters()
                            if isinstance(p.grad, DTensor)},
        "totals": totals,
        "per_module": per,
    }


def prepare_input_positional_and_keyword(module_kind: str, both: bool) -> dict:
    """PrepareModuleInput (or PrepareModuleInputOutput when ``both``) with a positional layout for
    ``x`` and a keyword layout for ``y``, ours vs torch's; the inner linear is column-wise in both."""
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    torch.manual_seed(0)
    base = {"kwonly": KwOnly, "kw_or_pos": KwOrPositional}[module_kind]()
    results = {}
    for side, lib in (("ours", hp), ("torch", tp)):
        model = copy.deepcopy(base)
        style = (lib.PrepareModuleInputOutput if both else lib.PrepareModuleInput)(**_prepare_args(both))
        if side == "ours":
            hp.parallelize_module(model.linear, mesh, hp.ColwiseParallel(use_local_output=False))
            hp.parallelize_module(model, mesh, style)
        else:
            tp.parallelize_module(model.linear, mesh, tp.ColwiseParallel(use_local_output=False))
            tp.parallelize_module(model, mesh, style)
        x, y = _inputs(dist.get_rank())

        def run(m, x=x, y=y):
            return m(x, y=y)

        rep = _report(model, run)
        rep["input_grads"] = [x.grad.clone(), y.grad.clone()]
        results[side] = rep
    return results


def sequence_parallel(norm_kind: str, reduce_grads: bool | None) -> dict:
    """A norm under SequenceParallel on a sequence-sharded DTensor input: ours (``reduce_grads``
    as given, None = the default) vs torch's."""
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    torch.manual_seed(0)
    base = nn.LayerNorm(D) if norm_kind == "layernorm" else RMSNorm(D)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(torch.randn_like(p))
    g = torch.Generator().manual_seed(7)
    whole = torch.randn(3, 4 * dist.get_world_size(), D, generator=g)
    results = {}
    for side in ("ours", "torch"):
        model = copy.deepcopy(base)
        if side == "ours":
            kw = {} if reduce_grads is None else {"reduce_grads": reduce_grads}
            hp.parallelize_module(model, mesh, hp.SequenceParallel(**kw))
        else:
            tp.parallelize_module(model, mesh, tp.SequenceParallel())
        inp = hp.distribute_tensor(whole.clone().requires_grad_(True), mesh, [Shard(1)])

        def run(m, inp=inp):
            return m(inp)

        results[side] = _report(model, run)
    return results
