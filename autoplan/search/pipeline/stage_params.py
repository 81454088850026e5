"""Which pipeline rank holds each parameter, as the runtime's stages hold them.

A parameter under a planner unit (embedding, block, final norm, head) lives on the stage holding
that unit. One under no unit (GPT-2's position table, OPT's projections around the decoder) lives
with the code that uses it: the stage whose forward runs the unit executed just before its first
use (in the captured execution order), so GPT-2's ``wpe`` sits with ``wte`` on the first stage and
OPT's ``project_out`` with the final norm on the last. A tied parameter used on two or more stages
(an embedding and its LM head) has a copy on each -- hyper_parallel's ``SharedParameters`` -- whose
gradients are summed over the pipeline group once per step (every pp rank takes part, ranks without
a copy adding zeros) and, under FSDP, left out of FSDP (``ignored_params``) and averaged over dp.
Counting a tied head nowhere missed its parameters, gradients and optimizer state on the last
stage (a 256K-vocabulary head: several GiB) and the all-reduce that keeps the copies equal.
"""
from __future__ import annotations

from typing import Sequence

from autoplan.capture.ir import ModelGraph


def _unit_of(module: str, unit_names: Sequence[str]) -> str | None:
    return next((u for u in unit_names if module == u or module.startswith(u + ".")), None)


def param_homes(graph: ModelGraph, unit_names: Sequence[str]) -> dict[str, str]:
    """{parameter FQN under no unit: the unit it lives with} (see the module docstring)."""
    out: dict[str, str] = {}
    last = unit_names[0] if unit_names else None
    for n in graph.nodes:
        unit = _unit_of(n.module, unit_names) if n.module else None
        if unit is not None:
            last = unit
        for src in n.input_nodes:
            if src.startswith("param:"):
                fqn = src[6:]
                if fqn not in out and _unit_of(fqn.rsplit(".", 1)[0], unit_names) is None and last is not None:
                    out[fqn] = last
    return out


def tied_holders(graph: ModelGraph, unit_names: Sequence[str], bounds: Sequence[tuple[int, int]]) -> dict[str, set[int]]:
    """{canonical parameter FQN (the tied group's first name, as ``param_shards`` counts it): the
    stages holding a copy} for every tied group whose members land on two or more stages
    (``bounds``: each stage's unit range over ``unit_names``)."""
    out = {}
    for group in graph.tied_parameters:
        stages = {s for s, (a, b) in enumerate(bounds) for name in group
                  if any(name.startswith(u + ".") for u in unit_names[a:b])}
        if len(stages) > 1:
            out[group[0]] = stages
    return out


def tied_copy_state(options, st, ctx) -> tuple[dict[str, float], dict[str, float]] | None:
    """(what the embedding's unit adds, what the head's unit holds) by kind (params, grads,
    optimizer) for a pipeline whose LM head is tied to the embedding, or None: the head's stage
    holds a copy of the table (the TP option's shard of it), and under FSDP both copies stay whole
    over dp (left out of FSDP), so the embedding's unit gets back what FSDP was counted to shard.
    ZeRO-1 still shards both copies' optimizer state (ordinary parameters of its flat buffer). A V
    schedule that puts the first and last stage on one rank keeps one Parameter there; this
    counts two."""
    if st.head is None or not st.head.tied or st.embedding is None:
        return None
    emb = next((o for o in options if o.slot == "embedding"), None)
    if emb is None or emb.param_bytes <= 0:
        return None
    elements = emb.param_bytes / ctx.param_bytes_per_element / emb.strategy.param_shard
    copy = {"params": elements * ctx.param_bytes_per_element, "grads": elements * ctx.param_bytes_per_element,
            "optimizer": elements * ctx.optimizer_bytes_per_element / (ctx.dp if ctx.dp_mode == "zero1" else 1)}
    counted = ctx.state_bytes(emb.param_bytes, emb.strategy.param_shard)
    back = {k: copy[k] - counted[k] for k in copy} if ctx.fsdp else {k: 0.0 for k in copy}
    return back, copy


def add_tied_copy(acc: list[list[float]], options, st, ctx, emb_i: int, head_i: int) -> None:
    """A pipeline's unit costs (``acc`` rows: [3] is the state bytes) with a tied head's copy
    (:func:`tied_copy_state`)."""
    extra = tied_copy_state(options, st, ctx)
    if extra is not None:
        acc[emb_i][3] += sum(extra[0].values())
        acc[head_i][3] += sum(extra[1].values())
