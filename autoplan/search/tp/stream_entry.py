"""Where the residual stream enters the sequence-sharded layout: the entry of each block stack.

A single decoder stack is scattered at its first block; an encoder-decoder's decoder starts again
from its own embedding on the whole sequence, so it enters again at its own first block, and the
encoder's output is gathered back at the decoder module's ``encoder_hidden_states`` for the cross
attention. ``stream_entry`` builds that one TP-search option; ``multi_stack_refusal`` says when the
structure does not allow it.
"""
from __future__ import annotations

from hyper_parallel import ParallelStyle, PrepareModuleInput, Replicate, Shard
from hyper_parallel.core.collective import Collective

from autoplan.search.tp.strategies import Strategy
from autoplan.search.units.structure import BlockGroupInfo

R, S = Replicate(), Shard(1)


# the keyword a second block stack (transformers' encoder-decoder decoders) takes the first
# stack's output by; multi_stack_refusal checks the structure it applies to
ENCODER_STATES = "encoder_hidden_states"


def stacks(blocks: list[BlockGroupInfo]) -> list[list[BlockGroupInfo]]:
    """The block groups of each block stack (one prefix: ``encoder.block``, ``decoder.block``), in
    the order the stacks first appear."""
    out: dict[str, list[BlockGroupInfo]] = {}
    for b in blocks:
        out.setdefault(b.prefix, []).append(b)
    return list(out.values())


def _first_block(stack: list[BlockGroupInfo]) -> tuple[BlockGroupInfo, str]:
    """The group holding a stack's first block, and that block's FQN (the lowest index: T5's
    block 0, which holds the position bias table, is a group of its own)."""
    def order(i: str) -> tuple:
        return (0, int(i), "") if i.isdigit() else (1, 0, i)
    index, group = min(((i, b) for b in stack for i in b.indices), key=lambda ib: order(ib[0]))
    return group, f"{group.prefix}.{index}" if group.prefix else index


def stream_entry(blocks: list[BlockGroupInfo], emb_layout: str, layout: str) -> Strategy | None:
    """Layout changes where the stream enters each block stack, when the stack's input differs
    from the stream; None if impossible (S -> R is never needed: the embedding can always produce R).

    The first stack reads the embedding's output (``emb_layout``). A later stack whose cross
    attention reads the first stack's output (an encoder-decoder's decoder) starts again from its
    own embedding on the whole sequence -- a table sharing the embedding's weight outputs R -- so
    on S it is scattered at its first block too, as Megatron scatters each stack's embedding
    output; and the first stack's output, sequence-sharded, is gathered back to the whole
    sequence at the later stack's own input (the stack module's ``encoder_hidden_states``). Its
    keys and values then read the same replicated tensor they read on R, each projection
    all-reducing its input gradient in backward as there, so the gather's backward only keeps
    the rank's shard. Other later stacks (a VL tower's) keep the stream as they find it; the
    probe judges such a plan."""
    if emb_layout == "S" and layout == "R":
        return None
    styles: dict[str, ParallelStyle] = {}
    colls: list[Collective] = []
    why: list[str] = []
    for i, stack in enumerate(stacks(blocks) if layout == "S" else []):
        cross = next((b.cross_attention for b in stack if b.cross_attention is not None), None)
        if (i == 0 and emb_layout == layout) or (i > 0 and cross is None):
            continue   # a later stack that reads no earlier one (a VL tower's) keeps the stream as it finds it
        if i == 0:   # the first block group's first member, as the planner has always entered it
            first = stack[0]
            fqn = f"{first.prefix}.{first.indices[0]}" if first.prefix else first.indices[0]
        else:
            first, fqn = _first_block(stack)
        styles[fqn] = PrepareModuleInput(input_layouts=(R,), desired_input_layouts=(S,), use_local_output=True)
        colls.append(Collective("all_gather", "backward", first.hidden_bytes))
        why.append(f"sequence sharded at {fqn}")
        if i > 0:
            module = first.prefix.rpartition(".")[0]
            styles[module] = PrepareModuleInput(input_kwarg_layouts={ENCODER_STATES: S},
                                                desired_input_kwarg_layouts={ENCODER_STATES: R},
                                                use_local_output=True)
            colls.append(Collective("all_gather", "forward", cross.kv_input_bytes))
            why.append(f"the first stack's output gathered at {module}'s {ENCODER_STATES} for its cross attention")
    if not styles:
        return Strategy("none", layout, {}, [])
    return Strategy("shard_sequence", "S", styles, colls,
                    reason="; ".join(why) + " (positions/masks computed on the full sequence)")


def multi_stack_refusal(blocks: list[BlockGroupInfo]) -> str | None:
    """Why a sequence-sharded stream cannot enter the block stacks (:func:`stream_entry`), or None:
    a later stack with a cross attention (an encoder-decoder's decoder) must be held by a module of
    its own, which takes the first stack's output as ``encoder_hidden_states``."""
    for stack in stacks(blocks)[1:]:
        first = stack[0]
        cross = next((b for b in stack if b.cross_attention is not None), None)
        if cross is not None and "." not in first.prefix:
            return (f"{first.prefix} starts a second block stack directly under the model, and its cross attention "
                    f"{first.prefix}.{cross.indices[0]}.{cross.cross_attention.rel} reads the first stack's output: "
                    f"no stack module takes that output where it could be gathered back to the whole sequence")
    return None
