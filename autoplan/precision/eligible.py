"""Which Linears of a model may train in float8 under a plan, and why the others may not.

A module stays in high precision, with the reason recorded in the plan, when it is

- not a plain ``nn.Linear`` (embeddings, norms, GPT-2's Conv1D, fused expert weights: torchao
  converts ``nn.Linear`` only; experts run torch's grouped GEMM in high precision -- torchao's
  float8 grouped GEMM is a prototype without an emulated path, so no plan here can check it),
- the language-model head (its logits feed the loss directly; torchtitan and Megatron keep it in
  high precision),
- a router (an MoE gate: its top-k choice is discontinuous, and its GEMM is tiny),
- a shape the float8 GEMM cannot take on this plan's shards (every dimension a rank sees must be a
  multiple of 16): a Column-split Linear sees out_features / tp, a Row-split one in_features / tp.

Everything else is *eligible*; whether float8 pays for it is the planner's choice (``choose``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch.nn as nn

from hyper_parallel import style_from_dict
from hyper_parallel.core.float8 import float8_shape_problem
from hyper_parallel.core.fqn_pattern import fqn_matches

_BLOCK_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


@dataclass(frozen=True)
class LinearSite:
    """One Linear as a plan shards it: features and how many ways each is split."""

    fqn: str
    in_features: int
    out_features: int
    shards: tuple[int, int]     # (in, out) ways


def head_names(model: nn.Module) -> set[str]:
    """FQNs of the model's output head (``get_output_embeddings`` where the model has it, else a
    Linear whose width is the input embedding's vocabulary)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)}
    return {fqn for fqn, m in model.named_modules()
            if m is head or (head is None and isinstance(m, nn.Linear) and m.out_features in vocab)}


def is_router(fqn: str, model: nn.Module) -> bool:
    """A Linear sitting beside an experts container (Mixtral's ``block_sparse_moe.gate``, Qwen-MoE's
    ``mlp.gate``, DeepSeek's ``mlp.gate``) -- the MoE router."""
    parent_name, _, _ = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    return any("expert" in name for name, _ in parent.named_children())


def _tp_ways(plan, fqn: str) -> tuple[int, int]:
    """(in, out) ways the plan's tensor parallel splits the Linear at ``fqn``."""
    tp = int(dict(zip(plan.mesh["names"], plan.mesh["shape"])).get(plan.tp_dim, 1)) if plan.tp_dim else 1
    hits = [(p, spec) for p, spec in plan.styles.items() if fqn_matches(p, fqn)]
    if tp == 1 or not hits:
        return (1, 1)
    _, spec = max(hits, key=lambda h: sum(1 for a in h[0].split(".") if "*" not in a))
    style = style_from_dict(spec)
    name = type(style).__name__
    if name == "ColwiseParallel":
        return (1, tp * int(getattr(style, "packed", 1)))
    if name == "RowwiseParallel":
        return (tp, 1)
    return (1, 1)


def float8_sites(model: nn.Module, plan, recipe: str) -> tuple[list[LinearSite], dict[str, str]]:
    """(the Linears that may run ``recipe`` under ``plan``, {fqn: why not} for every other Linear)."""
    heads = head_names(model)
    sites, kept = [], {}
    for fqn, m in model.named_modules():
        if not isinstance(m, nn.Linear) or not fqn:
            continue
        if type(m) is not nn.Linear:
            kept[fqn] = f"a {type(m).__name__}, not a plain nn.Linear"
        elif fqn in heads:
            kept[fqn] = "the output head (its logits feed the loss; kept in high precision as torchtitan does)"
        elif is_router(fqn, model):
            kept[fqn] = "an MoE router (a discontinuous top-k on a tiny GEMM)"
        else:
            ways = _tp_ways(plan, fqn)
            problem = float8_shape_problem(m.in_features, m.out_features, recipe, ways)
            if problem:
                kept[fqn] = problem
            else:
                sites.append(LinearSite(fqn, m.in_features, m.out_features, ways))
    return sites, kept


def as_patterns(decisions: dict[str, str]) -> dict[str, str]:
    """{fqn: value} folded over repeated blocks: ``layers.3.mlp.up`` -> ``layers.*.mlp.up`` when
    every block with that path has the same value; FQNs whose blocks disagree stay whole."""
    groups: dict[str, dict[str, str]] = {}
    for fqn, value in decisions.items():
        groups.setdefault(_BLOCK_INDEX.sub(".*", fqn, count=1), {})[fqn] = value
    out = {}
    for pattern, members in groups.items():
        values = set(members.values())
        if len(values) == 1 and pattern != next(iter(members)):
            out[pattern] = values.pop()
        else:
            out.update(members)
    return out
