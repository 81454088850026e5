"""Small modules, each parallelized by one style (or a minimal pair), with their expected
per-module collective counts. Shared by the numerics, communication and torch-parity tests.

Expected counts follow from the styles' semantics (forward, backward), inputs requiring grad:
Colwise on a replicated input all-reduces the input gradient (partial) in backward; Rowwise
with Replicate output all-reduces its partial output in forward, with Shard(1) output it
reduce-scatters (backward: all-gather); Rowwise fed a Replicate input slices it (backward:
all-gather of the input gradient); a Shard(1) -> Replicate change is an all-gather whose
backward is a local slice; SequenceParallel leaves its weight gradient Partial (as torch's) or, with
``reduce_grads=True``, all-reduces it in backward (align_grad_to_param);
NoParallel on replicated inputs communicates nothing. CommDebugMode counts a module's
descendants in its own numbers and attributes backward collectives of a parent's hooks to the
child whose backward ran last (e.g. "norm" below).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from autoplan.models.llama import RMSNorm
from hyper_parallel import (
    ColwiseParallel,
    NoParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
)

D, H, V, B, S = 16, 32, 64, 2, 8


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)

    def forward(self, tokens):
        return self.emb(tokens)


class NormBlock(nn.Module):
    """A norm computed on a sequence shard between two layout changes."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(D)
        with torch.no_grad():
            self.norm.weight.uniform_(0.5, 1.5)

    def forward(self, x):
        return self.norm(x) * 2.0


class KwargBlock(nn.Module):
    """HF-style: the hidden states arrive as a keyword argument."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)

    def forward(self, hidden_states, scale=1.0):
        return self.proj(hidden_states) * scale


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, 4, bias=False)

    def forward(self, x):
        return self.gate(x).softmax(-1)


def _float_input(seed: int = 0):
    return torch.randn(B, S, D, generator=torch.Generator().manual_seed(seed))


def _tokens(seed: int = 0):
    return torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))


# name -> (module factory, input factory, call kwargs, plan, expected {fqn: (forward, backward)})
CASES = {
    "colwise_linear": (
        lambda: nn.Sequential(nn.Linear(D, H)), _float_input, {},
        {"0": ColwiseParallel(output_layouts=Replicate())},
        {"0": ({"all_gather": 1}, {"all_reduce": 1})},
    ),
    "rowwise_linear": (
        lambda: nn.Sequential(nn.Linear(H, D)), lambda: torch.randn(B, S, H), {},
        {"0": RowwiseParallel(input_layouts=Replicate())},
        {"0": ({"all_reduce": 1}, {"all_gather": 1})},
    ),
    "colwise_rowwise_mlp": (
        MLP, _float_input, {}, {"up": ColwiseParallel(), "down": RowwiseParallel()},
        {"up": ({}, {"all_reduce": 1}), "down": ({"all_reduce": 1}, {})},
    ),
    "mlp_sequence_parallel_output": (
        MLP, _float_input, {},
        {"up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Shard(1)),
         "": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())},
        {"up": ({}, {"all_reduce": 1}), "down": ({"reduce_scatter": 1}, {"all_gather": 1})},
    ),
    "colwise_embedding": (
        Embed, _tokens, {}, {"emb": ColwiseParallel(output_layouts=Replicate())},
        {"emb": ({"all_gather": 1}, {})},
    ),
    "rowwise_embedding": (
        Embed, _tokens, {}, {"emb": RowwiseParallel()},
        {"emb": ({"all_reduce": 1}, {})},
    ),
    "sequence_parallel_norm": (
        NormBlock, _float_input, {},
        {"": PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                      output_layouts=Shard(1), desired_output_layouts=Replicate()),
         "norm": SequenceParallel()},
        {"norm": ({}, {"all_gather": 1}), "": ({"all_gather": 1}, {"all_gather": 1})},
    ),
    "sequence_parallel_norm_reduced": (
        NormBlock, _float_input, {},
        {"": PrepareModuleInputOutput(input_layouts=Replicate(), desired_input_layouts=Shard(1),
                                      output_layouts=Shard(1), desired_output_layouts=Replicate()),
         "norm": SequenceParallel(reduce_grads=True)},
        {"norm": ({}, {"all_gather": 1, "all_reduce": 1}), "": ({"all_gather": 1}, {"all_gather": 1, "all_reduce": 1})},
    ),
    "prepare_input_kwarg": (
        KwargBlock, None, {"hidden_states": _float_input(), "scale": 0.5},
        {"": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
         "proj": ColwiseParallel(output_layouts=Replicate())},
        {"proj": ({"all_gather": 1}, {"all_reduce": 1}), "": ({"all_gather": 1}, {"all_reduce": 1})},
    ),
    "prepare_output": (
        lambda: nn.Sequential(nn.Linear(D, H)), _float_input, {},
        {"0": ColwiseParallel(use_local_output=False)},
        {"0": ({}, {"all_reduce": 1})},
    ),
    "no_parallel_router": (
        Router, _float_input, {},
        {"": NoParallel()},
        {"": ({}, {})},
    ),
}

# "prepare_output" wraps its Sequential's output with a PrepareModuleOutput at the root
CASES["prepare_output"] = CASES["prepare_output"][:3] + (
    {"0": ColwiseParallel(use_local_output=False),
     "": PrepareModuleOutput(output_layouts=Shard(-1), desired_output_layouts=Replicate())},
    {"0": ({}, {"all_reduce": 1}), "": ({"all_gather": 1}, {"all_reduce": 1})},
)


def build_case(name: str, seed: int = 0):
    factory, make_input, kwargs, plan, expected = CASES[name]
    torch.manual_seed(seed)
    module = factory()
    args = (make_input(),) if make_input is not None else ()
    return module, args, kwargs, plan, expected

# torch's PrepareModuleInput matches positional layouts only against positional inputs, so a
# block called HF-style (hidden_states=...) fails there ("module inputs and input_layouts should
# have same length"); ours binds them by parameter name.
TORCH_CANNOT = {"prepare_input_kwarg"}
