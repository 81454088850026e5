"""Rank functions for tests/runtime/test_sequence_region.py: a unit that needs the whole sequence
(a scan) inside a sequence-sharded stream, returning its tokens flattened beside a second output,
and a per-token MLP on flattened tokens sharded on dim 0 -- one step compared with one device."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hyper_parallel import ColwiseParallel, PrepareModuleInput, Replicate, RowwiseParallel, Shard, parallelize_module
from hyper_parallel.core.tensor_parallel.sequence_region import GatheredRegion
from hyper_parallel.local import cached_mesh
from hyper_parallel.testing.compare import compare_steps

DIM, VOCAB = 16, 32


class Scan(nn.Module):
    """Mixes every earlier token (a cumulative sum: what a Mamba scan needs), returns the tokens
    flattened to (batch * sequence, hidden) and an auxiliary output (Llama-4's MoE returns its
    router logits so)."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False)

    def forward(self, hidden_states):
        y = self.out(torch.tanh(self.inp(hidden_states)).cumsum(1))
        return y.reshape(-1, y.shape[-1]), y.square().mean()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.scan, self.up, self.down = Scan(), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        x = x + self.scan(hidden_states=x)[0].view(x.shape)
        t = x.reshape(-1, x.shape[-1])          # tokens flattened before the MLP (OPT's layer)
        t = t + self.down(F.gelu(self.up(t)))
        return t.view(x.shape)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.block, self.head = nn.Embedding(VOCAB, DIM), Block(), nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        return self.head(self.block(self.emb(tokens)))


def ce(logits, target):
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def par_loss(model, tokens, target):
    loss = ce(model(tokens), target)
    loss.backward()
    return loss


def check_gathered_region() -> tuple:
    """(ok, losses, grad mismatches, missing grads) of the sequence-sharded plan against one device."""
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g))
            for _ in range(2)]
    ref, par = Model(), Model()
    S, R = Shard(1), Replicate()
    parallelize_module(par, mesh, {
        "block": PrepareModuleInput(input_layouts=(R,), desired_input_layouts=(S,), use_local_output=True),
        "block.scan": GatheredRegion(sequence_dim=1),
        "block.up": ColwiseParallel(input_layouts=Shard(0)),
        "block.down": RowwiseParallel(output_layouts=Shard(0)),
        "head": PrepareModuleInput(input_layouts=(S,), desired_input_layouts=(R,), use_local_output=True)})
    res = compare_steps(ref, par, data, ce, par_loss)
    return res.ok, res.ref_losses, res.par_losses, res.grad_mismatches[:5], res.missing_grads[:5]
