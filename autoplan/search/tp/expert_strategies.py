"""Strategies for a mixture-of-experts layer on a tensor-parallel mesh without an ep dimension.

Every rank keeps every expert and the router; each expert is split on its ffn width (gate/up
column-wise, down row-wise: ``ExpertParallel(ep_dim="")``, transformers' ``moe_tp_experts``).
The tokens each rank routes are the same, so the experts' rows are copied into the split (their
gradient all-reduced in backward) and the partial expert outputs all-reduced in forward -- two
all-reduces of the routed rows (tokens x top-k x hidden) per layer. On a sequence-sharded stream
the container gathers the sequence at its input and slices it out of its output. Flat experts
(DBRX's, FlatExpertsParallel) copy the hidden states themselves (not routed rows: the roles entry
has no top-k, so ``rows`` is the hidden stream) and the routing weights into the split: a third
all-reduce, of the weights' gradient in backward.

A mesh with an ep dimension plans the experts in ``expert_plan`` instead (expert parallelism,
optionally with expert TP inside each ep group); the TP search then offers only these.
"""
from __future__ import annotations

import dataclasses

from hyper_parallel import Replicate, Shard
from hyper_parallel.core.expert_parallel import (DenseExpertsParallel, ExpertParallel, FlatExpertsParallel,
                                                PairedExpertsParallel)
from hyper_parallel.core.collective import Collective
from hyper_parallel.core.tensor_parallel.sequence_region import GatheredRegion

from autoplan.search.tp.strategies import Strategy, _replicated_region_on_s
from autoplan.search.units.mixers import MoeUnit
from autoplan.search.units.structure import BlockGroupInfo

R, S = Replicate(), Shard(1)


def experts_strategies(m: MoeUnit, blk: BlockGroupInfo, t: int, layout: str) -> list[Strategy]:
    """Replicated, or each expert split over tp (when its ffn width divides tp)."""
    h = blk.hidden_bytes
    if layout == "R":
        out = [Strategy("replicate", "R", {}, [], reason="router and experts replicated")]
    else:
        out = [Strategy("replicate", "S", _container(m, S), _replicated_region_on_s(h),
                        reason="router and experts replicated on the gathered sequence")]
    if t == 1:
        return out
    if m.ffn % t:
        out[0].extra["tp_excluded"] = f"expert ffn width {m.ffn} not divisible by tp={t}"
        return out
    # the experts held by the MoE container itself (JetMoE): the split style also gathers the stream
    own_region = layout == "S" and bool(m.paired) and m.rel == m.experts
    rows = h * m.top_k
    comm = [Collective("all_reduce", "forward", rows), Collective("all_reduce", "backward", rows)]
    if m.flat and m.routing_weights:   # the routing weights are copied into the split too: their gradient
        num, den = m.routing_weights    # (tokens x top-k, partial on each rank) all-reduced in backward
        comm.append(Collective("all_reduce", "backward", h * num // den))
    if m.paired:
        style = PairedExpertsParallel(**m.paired, **({"sequence_dim": 1} if own_region else {}))
    else:
        style = FlatExpertsParallel() if m.flat else ExpertParallel(ep_dim="")
    styles = {m.experts: style}
    if layout == "S":
        if not own_region:
            styles.update(_container(m, S))
        comm += _replicated_region_on_s(h)
    # the experts' share of the unit is split t ways, the router's stays whole
    total, part = max(m.work.params, 1), m.expert_work.params
    param_shard = total / (total - part + part / t)
    flops, eflops = max(m.work.flops, 1.0), m.expert_work.flops
    why = f"each of the {m.num_experts} experts split on its ffn width ({m.ffn}) over tp: gate/up column-wise, " \
          f"down row-wise; router replicated"
    shards = dict(compute_shard=flops / (flops - eflops + eflops / t), param_shard=param_shard, activation_shard=1.0)
    out.append(Strategy("experts_tp", layout, styles, comm, reason=why, **shards))
    if m.flat or m.paired:   # flat (E * F, H) weights or an up/down pair: their own style, no dense form
        return out
    # experts that run every expert on tokens the block pre-scaled (Llama-4): the probe picks the
    # form the module's forward takes; the dense one moves every expert's copy of every token
    dense = dict(styles, **{m.experts: DenseExpertsParallel()})
    rows_all = h * m.num_experts
    out.append(Strategy("experts_tp_dense", layout, dense,
                        [Collective("all_reduce", "forward", rows_all), Collective("all_reduce", "backward", rows_all)]
                        + comm[2:], reason=f"{why} (experts run on every token copy)",
                        extra={"fallback_for": "experts_tp"}, **shards))
    return out


def within_container(strategies, unit, blk: BlockGroupInfo, t: int, layout: str, *args) -> list[Strategy]:
    """``strategies(unit, blk, t, layout, *args)``, for a unit that may sit inside the block's MoE
    container (DeepSeek-V3's and Llama-4's shared experts): on a sequence-sharded stream every
    form of the container gathers the sequence at its input and slices it out of its output, so
    such a unit sees a replicated stream -- its replicated-stream forms, labelled with the block's
    stream."""
    moe = blk.moe
    if layout != "S" or moe is None or not moe.rel or not unit.rel.startswith(moe.rel + "."):
        return strategies(unit, blk, t, layout, *args)
    return [dataclasses.replace(s, stream=layout, reason=f"{s.reason} (inside {moe.rel}, on its gathered sequence)")
            for s in strategies(unit, blk, t, "R", *args)]


def _container(m: MoeUnit, layout) -> dict:
    """The MoE container taking the sequence-sharded stream in whole and giving its shard back
    (its first output: an MoE layer may also return its router logits, or flatten the tokens)."""
    return {m.rel: GatheredRegion(sequence_dim=layout.dim)}
