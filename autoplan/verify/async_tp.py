"""Verify sees async TP: the fused collective-matmuls a plan's compiled block gets.

Async tensor parallelism is inductor's micro-pipeline pass fusing each sequence-parallel
all-gather with the matmuls that consume it and each reduce-scatter with the matmul that feeds
it. The planner prices a sequence-parallel linear's collective as hidden behind its matmul only
if that fusion happens, so verify checks it on the plan's own styles: a small copy of the model
gets the plan applied on a fake process group of the plan's world, one repeated block is compiled
with a backend that keeps AOT autograd's forward and backward graphs, and torch's own post-grad
passes with micro-pipeline TP run on them (``hyper_parallel.core.async_tp.fused_matmul_collectives``).
Every tensor-parallel module of the block whose forward is a plain matmul must sit inside a fused
op in the forward (what the planner prices fused); a module that adds its bias in the same op (an
``addmm``) is not fused by the pass and is priced exposed. The fused kernels themselves need CUDA,
NCCL and symmetric memory; where they are
missing the check still runs (the pass is graph rewriting) and says what it could not run.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch._functorch.aot_autograd import aot_module_simplified
from torch._inductor.decomposition import select_decomp_table
from torch.distributed.device_mesh import init_device_mesh

from autoplan.parallelisms.registry import batch_shards
from autoplan.plan.plan import Plan
from autoplan.plan.runner import block_modules
from autoplan.verify.numerics import _vocab, small_plan
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.core.async_tp import async_tp_blockers, fused_matmul_collectives
from hyper_parallel.core.tensor_parallel import match_modules
from hyper_parallel.local import fake_world

log = logging.getLogger(__name__)


@dataclass
class AsyncTPCheck:
    """``expected``: the tensor-parallel weight modules of the checked block whose forward is a
    plain matmul (no bias added in the same op: what the pass can fuse and the planner prices
    fused, ``search/pricing/async_tp.py``); ``biased``: those that add a bias (an ``addmm``, priced
    exposed); ``forward`` / ``backward``: what the pass fused over that direction's AOT graphs
    (``all_gather``, ``reduce_scatter``, ``matmuls`` inside them, ``left``: sequence-parallel
    collectives it left unfused); ``cannot_run``: why the fused kernels would not run on this
    machine (the patterns were checked anyway)."""

    block: str
    expected: int
    biased: int = 0
    forward: dict = field(default_factory=dict)
    backward: dict = field(default_factory=dict)
    cannot_run: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """What the planner priced fused is fused: every plain-matmul TP module of the block inside
        a fused op in the forward, and no collective left there unless a biased module explains it.
        The backward is reported, not required: a gradient summed over several column-parallel
        linears (q, k and v read one input) reaches its reduce-scatter through an add, which the
        pass does not fuse -- torch's limit, the same for torchtitan's plans, and priced so."""
        return self.forward.get("matmuls", 0) >= self.expected and (self.biased > 0 or self.forward.get("left", 1) == 0)

    def summary(self) -> str:
        parts = [f"{d}: {g.get('matmuls', 0)} matmuls in {g.get('all_gather', 0)} all-gather + "
                 f"{g.get('reduce_scatter', 0)} reduce-scatter fusions, {g.get('left', 0)} collectives left"
                 for d, g in (("forward", self.forward), ("backward", self.backward))]
        where = f"; not runnable here ({'; '.join(self.cannot_run)}), patterns checked" if self.cannot_run else ""
        return (f"async TP on {self.block}: {self.expected} tensor-parallel plain-matmul modules"
                + (f" ({self.biased} with a bias, not fusible)" if self.biased else "") + "; "
                + "; ".join(parts) + where)


def _total(counts: list[dict]) -> dict:
    out: Counter = Counter()
    for c in counts:
        out.update(c)
    return dict(out)


def _tp_weights(model: nn.Module, plan: Plan, block: nn.Module) -> tuple[int, int]:
    """(plain, biased): the modules of ``block`` a style of ``plan`` shards whose weight is a matrix
    (a Linear, GPT-2's Conv1D), split by whether they add a bias."""
    inside = {id(m) for m in block.modules()}
    styled = {id(m) for pattern in plan.styles for _, m in match_modules(model, pattern)}
    mods = [m for m in block.modules() if id(m) in styled and id(m) in inside
            and getattr(m, "weight", None) is not None and m.weight.dim() == 2 and not isinstance(m, nn.Embedding)]
    biased = sum(1 for m in mods if getattr(m, "bias", None) is not None)
    return len(mods) - biased, biased


def check_async_tp(plan: Plan, recipe: ModelRecipe, *, seq: int = 32) -> AsyncTPCheck:
    """Apply ``plan`` to the small copy ``recipe`` builds on a fake world of the plan's size, compile
    its first repeated block keeping AOT autograd's graphs, run one step, and count the fusions."""
    if plan.stream_layout != "S":
        raise ValueError(f"check_async_tp: the plan's stream layout is {plan.stream_layout!r}; async TP fuses the "
                         "collectives of a sequence-parallel plan (stream layout 'S')")
    shape, names = tuple(plan.mesh["shape"]), tuple(plan.mesh["names"])
    graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}

    def keeper(direction: str):
        def keep(gm, _inputs):
            graphs[direction].append(gm)
            return gm
        return keep

    def backend(gm, inputs):
        return aot_module_simplified(gm, inputs, fw_compiler=keeper("forward"), bw_compiler=keeper("backward"),
                                     decompositions=select_decomp_table())

    with fake_world(math.prod(shape)):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = recipe.build()
        small = small_plan(plan, model)
        runner = small.apply(model, mesh)
        blocks = block_modules(model, small)
        if not blocks:
            raise ValueError("check_async_tp: the plan names no repeated blocks to compile")
        block = blocks[0]
        name = next(n for n, m in model.named_modules() if m is block)
        expected, biased = _tp_weights(model, small, block)
        block.compile(backend=backend)
        vocab = _vocab(model)
        # two rows per batch shard: with one, the gathered (1, S, H) sequence is a reshape of the
        # flat all-gather and the pass sees reshape -> reshape -> mm, a form no real batch takes
        tokens = torch.randint(0, vocab, (2 * batch_shards(small), seq))
        x, y = runner.local_batch(tokens, tokens)
        if hasattr(runner, "forward_backward"):
            runner.forward_backward(x, y)
        else:
            runner.step((x, y))
        fused = {d: _total([fused_matmul_collectives(g) for g in gs]) for d, gs in graphs.items()}
        blockers = async_tp_blockers(mesh[plan.tp_dim])
    return AsyncTPCheck(block=name, expected=expected, biased=biased, forward=fused["forward"], backward=fused["backward"],
                        cannot_run=blockers)
