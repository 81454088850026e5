"""Context (cp) and expert (ep) parallelism as dimensions of the cluster search.

Why here and not in an outer loop over ``plan_cluster`` calls: the pipeline search, the
micro-batch choice and the memory check all need cp's and ep's price per pipeline unit (a cp
rank holds seq/cp tokens of every block; an ep rank a fraction of every MoE layer's experts),
so they are priced the way the search prices everything else -- as additions to the per-unit
costs (``pipeline.search.UnitCost``) of the TP solution -- and the mesh factorizations gain a cp
or an ep degree. The prices themselves are not written again: cp's comes from
``context.cost.price_cp`` (the runtime's ``predicted_collectives``, ring overlap rule), ep's from
``experts.planning.ExpertPlanning`` (the runtime's all-to-alls, imbalance factor), the same objects the
fixed-mesh planner (``mesh_plan.plan_mesh``) uses for the plan it then writes.

Mesh layout: ``(dp, cp | ep, pp, tp)``; ``(dp, pp, ep, tp)`` for ep with a pipeline (``cluster_spec``).
cp sits right after dp (gradients average over the
flattened dp x cp mesh, FSDP on it, as torchtitan folds cp into FSDP); ep borrows from dp (each
ep rank holds other sequences, as torchtitan's EP borrows data-parallel ranks), so the batch is
split dp x ep ways. One of cp and ep per plan (not both yet).

Which degrees are tried (the search's cost grows with one capture per (micro-batch, cp)):
- cp: only for sequences of at least ``CP_MIN_SEQ`` tokens (below that tp, pp and dp are
  cheaper and a short chunk starves the attention blocks that hide the ring), powers of two
  with chunks of at least ``CP_MIN_CHUNK`` tokens, on a causal model the ContextParallel style
  can hook; with cp > 1 a micro-batch is one sequence (context parallelism exists because one
  sequence is already too big), and at such lengths every micro-batch is one sequence.
- ep: for models whose capture recognised MoE layers ExpertParallel takes (3-D expert
  weights), powers of two dividing every MoE layer's expert count, with or without a pipeline
  (the pipeline runner shards every micro-batch over ep inside the stages).
``constraints={"cp": k}`` / ``{"ep": k}`` fix the degree (1 turns it off).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

from autoplan.search.context.cost import CPChoice, CPShape, price_cp
from autoplan.search.experts.planning import ExpertPlanning
from autoplan.search.experts.search import OUR_EXPERT_RUNTIME, ExpertRuntime, expert_time, moe_groups
from autoplan.search.units.targets import owner_units
from hyper_parallel.core.collective import Collective
from hyper_parallel.core.context_parallel import ContextParallel
from hyper_parallel.errors import HyperParallelError
from hyper_parallel.parallel_dims import ParallelDims

log = logging.getLogger(__name__)
CP_MIN_SEQ = 32768     # tokens per sequence from which cp > 1 is tried
CP_MIN_CHUNK = 4096    # tokens per cp rank at least (seq / cp)


def cluster_names(cp: int = 1, ep: int = 1, pp: int = 1) -> tuple[str, ...]:
    """Mesh dimension names of a cluster plan: dp, then cp or ep when used, pp, tp -- except ep with
    a pipeline: dp, pp, ep, tp (see :func:`cluster_spec`)."""
    if ep > 1 and pp > 1:
        return ("dp",) + (("cp",) if cp > 1 else ()) + ("pp", "ep", "tp")
    return ("dp",) + (("cp",) if cp > 1 else ()) + (("ep",) if ep > 1 else ()) + ("pp", "tp")


def cluster_spec(dp: int, pp: int, tp: int, cp: int, ep: int, hardware: str, devices_per_node: int) -> ParallelDims:
    """The ParallelDims of one candidate (size-1 cp / ep left out, dp / pp / tp always named).

    With ep and a pipeline the ep dimension sits inside pp (next to tp): an expert group's
    all-to-alls, every layer and micro-batch, stay on NVLink when ep x tp fits a node, and the
    pipeline's one activation per hop takes the slower link -- as Megatron-Core (pp outermost, ep
    within dp) and torchtitan (pp outside dp_shard x ep) lay it out. Without a pipeline the two
    orders are the same ranks, so (dp, ep, pp=1, tp) stays."""
    if ep > 1 and pp > 1:
        shape: tuple[int, ...] = (dp,) + ((cp,) if cp > 1 else ()) + (pp, ep, tp)
    else:
        shape = (dp,) + ((cp,) if cp > 1 else ()) + ((ep,) if ep > 1 else ()) + (pp, tp)
    return ParallelDims(shape, cluster_names(cp, ep, pp), hardware, devices_per_node)


def _powers_of_two(limit: int) -> list[int]:
    out, k = [], 2
    while k <= limit:
        out.append(k)
        k *= 2
    return out


def cp_degrees(model, seq: int, devices: int, constraints: dict) -> list[int]:
    """cp degrees to try (1 always first unless a constraint fixes another; see the module docstring)."""
    if "cp" in constraints:
        return [int(constraints["cp"])]
    if seq < CP_MIN_SEQ:
        return [1]
    try:
        ContextParallel().check_model(model, "plan_cluster (cp)")
    except HyperParallelError as e:
        log.info("plan_cluster: no context parallelism: %s", e)
        return [1]
    return [1] + [c for c in _powers_of_two(devices) if devices % c == 0 and seq % (2 * c) == 0
                  and seq // c >= CP_MIN_CHUNK]


def ep_degrees(groups: Sequence, devices: int, constraints: dict) -> list[int]:
    """ep degrees to try for the model's MoE ``groups`` (``experts.search.moe_groups``)."""
    if "ep" in constraints:
        return [int(constraints["ep"])]
    stacked = [g for g in groups if g.layout.kind == "stacked"]
    if not stacked or len(stacked) != len(groups):
        return [1]
    return [1] + [e for e in _powers_of_two(devices) if devices % e == 0 and all(g.experts % e == 0 for g in groups)]


def model_moe_groups(meta, graph, dtype_bytes: int) -> list:
    """The MoE groups ExpertParallel can take, from one captured graph."""
    return moe_groups(graph, meta, dtype_bytes)


def add_cp(acc: list[list[float]], names: list[str], structure, graph, ctx, chosen: dict, shape: CPShape, *,
           memory_left: float) -> CPChoice:
    """Add context parallelism's exposed exchange (forward part to F, the rest to backward-input)
    and the all-gather variant's extra saved K/V to each block unit of ``acc`` (rows F, I, W,
    state, act, ...), one micro-batch of ``shape.local_batch`` sequences; returns the priced choice."""
    choice = price_cp(structure, graph, ctx, chosen, shape, memory_left=memory_left)
    index = {n: i for i, n in enumerate(names)}
    for g in structure.blocks:
        if g.attention is None:
            continue
        # this group's share of the variant the whole model chose
        one = price_cp(dataclasses.replace(structure, blocks=[g]), graph, ctx, chosen, shape,
                       memory_left=0.0).candidates[choice.variant]
        units = [index[u] for u in owner_units(f"{g.prefix}.*", g.prefix, g.indices) if u in index]
        if not units:
            continue
        fwd = one["exposed_forward_s"] / len(units)
        bwd = (one["exposed_s"] - one["exposed_forward_s"]) / len(units)
        extra = one["extra_memory"] / len(units)
        for i in units:
            acc[i][0] += fwd
            acc[i][1] += bwd
            acc[i][4] += extra
    return choice


def cp_layer_rows(structure, graph, ctx, chosen: dict, variant: str, shape: CPShape) -> dict[str, list[Collective]]:
    """Block group id -> the cp exchange of ONE of its layers for one micro-batch of
    ``shape.local_batch`` sequences, in ``variant`` (what a pipeline rank issues per block it holds)."""
    out = {}
    for g in structure.blocks:
        if g.attention is None:
            continue
        one = price_cp(dataclasses.replace(structure, blocks=[g]), graph, ctx, chosen, shape,
                       memory_left=float("inf"), variants=[variant])
        out[g.id] = [dataclasses.replace(c, count=c.count // g.count) for c in one.collectives
                     if c.dim == "cp"]
    return out


def add_ep(acc: list[list[float]], names: list[str], options, targets, experts: ExpertPlanning,
           dp_mode: str | None = None) -> bool:
    """Add expert parallelism's price to the units of ``acc`` (rows F, I, W, state, act, dp_comm,
    dp_gather, optimizer): per MoE layer the chosen option's compute beyond the replicated experts
    the TP search counted, its all-to-alls and expert-TP all-reduces (forward / backward), its
    expert state instead of the replicated one, the experts' data-parallel traffic and optimizer
    step at their sharded size; and per step, for the gradients outside the experts, what the
    runtime does with them: under FSDP their FSDP traffic and state over dp x ep
    (``parallelisms.data.state_mesh``), under ZeRO-1 the ep stage of its reduce-scatter and
    all-gather over dp x ep and the optimizer state / ep (``data.zero1_of``), with replicated dp one
    all-reduce over ep (serial, after backward: ``parallelisms.expert.ExpertGradSync``).
    ``options``/``targets``: the TP solution's options and the unit indices each one covers.
    ``dp_mode``: the data-parallel mode the plan asked for (default: the context's). With dp = 1 the
    context prices "replicate" (nothing to shard over dp), but FSDP and ZeRO-1 still shard the
    non-expert state ep ways (AutoModel's "FSDP 64" at dp 1 x ep 64 is FSDP2 over the 64 ranks for
    every non-expert weight, as ours is): each unit all-gathered (forward and backward) and
    reduce-scattered over ep as at dp > 1. Returns whether the non-expert units run FSDP (so a single
    stage pays their traffic every micro-batch, as ``pipeline_search`` prices an FSDP unit)."""
    ctx, runtime = experts.ctx, experts.runtime   # the runtime the experts were priced for
    index = {n: i for i, n in enumerate(names)}
    expert_units: dict[int, float] = {}   # unit -> expert weight bytes it holds (whole)
    for g, o, opts in zip(experts.choice.groups, experts.choice.chosen, experts.choice.options):
        owner = g.pattern[: -len(g.rel) - 1]
        units = [index[u] for u in owner_units(owner, g.block_prefix, g.indices) if u in index]
        if not units:
            continue
        base = opts[0]
        n = len(units)
        # against what the TP search counted for these experts (their captured work, replicated)
        delta = (o.compute_s - ctx.compute_time(g.work, 1) * g.count) / n
        colls = list(o.collectives)
        fwd = runtime.a2a_time(ctx, [c for c in colls if c.phase == "forward"], g.top_k, g.experts) / n \
            if o.style is not None else 0.0
        bwd = runtime.a2a_time(ctx, [c for c in colls if c.phase != "forward"], g.top_k, g.experts) / n \
            if o.style is not None else 0.0
        if o.style is not None and ctx.checkpoint_blocks:   # the recomputed forward dispatches again
            bwd += fwd
        shard = experts.ep * (experts.tp if o.style is not None and o.style.tp_dim else 1) if o.style else 1
        whole = g.param_bytes
        dp_whole = ctx.comm_time(ctx.fsdp_collectives(whole, 1) + ctx.ddp_collectives(whole, 1), latency=not ctx.fsdp)
        dp_shard = ctx.comm_time(ctx.fsdp_collectives(whole, shard) + ctx.ddp_collectives(whole, shard),
                                 latency=not ctx.fsdp)
        # one FSDP all-gather of the layer (what a pipeline re-gathers when it finds the unit
        # resharded, row 6): the expert shard's bytes too, not the whole layer's
        gather_whole = ctx.comm_time(ctx.fsdp_collectives(whole, 1)[:1], latency=False)
        gather_shard = ctx.comm_time(ctx.fsdp_collectives(whole, shard)[:1], latency=False)
        opt_whole = ctx.optimizer_time(0, ctx.optimizer_elements(whole, 1), ctx.dp_mode != "replicate")
        opt_shard = ctx.optimizer_time(0, ctx.optimizer_elements(whole, shard), ctx.dp_mode != "replicate")
        for i in units:
            # a runtime that overlaps the all-to-alls hides them behind the unit's compute (the
            # other micro-batch's, as much of it as there is); ours exposes them (runtime.overlap 0)
            acc[i][0] += delta / 3 + runtime.exposed(fwd, acc[i][0] + delta / 3)
            acc[i][1] += delta / 3 + runtime.exposed(bwd, acc[i][1] + acc[i][2] + 2 * delta / 3)
            acc[i][2] += delta / 3
            acc[i][3] += (o.state_bytes - base.state_bytes) / n
            per_layer = g.count / n
            if o.style is None:   # replicated experts: ep is data parallel for them
                acc[i][5] += ctx.comm_time(colls) / n
            else:
                acc[i][5] += (dp_shard - dp_whole) * per_layer
                acc[i][6] += (gather_shard - gather_whole) * per_layer
                acc[i][7] += (opt_shard - opt_whole) * per_layer
                expert_units[i] = expert_units.get(i, 0.0) + whole * per_layer
    # the all-reduce over ep of every non-expert gradient, this rank's local bytes
    local = [0.0] * len(names)
    fsdp = ctx.dp if ctx.fsdp else 1
    for o, tg in zip(options, targets):
        if not tg:
            continue
        for t in tg:
            local[t] += o.count * o.param_bytes / o.strategy.param_shard / len(tg)
    for i, nbytes in expert_units.items():
        local[i] = max(local[i] - nbytes, 0.0)
    # FSDP and ZeRO-1 shard the non-expert state over dp x ep, at dp 1 too, in every runtime
    # priced, ours included (parallelisms.data.state_mesh / zero1_of); a runtime stated with
    # ``dense_state_over_ep`` does so with replicated dp as well
    mode = dp_mode or ctx.dp_mode
    over_ep = runtime.dense_state_over_ep or mode in ("fsdp", "zero1")
    fsdp_over_ep = mode == "fsdp"
    if over_ep:
        sharded = {"fsdp": ("params", "grads", "optimizer"), "zero1": ("optimizer",)}.get(mode, ())
        for i, nbytes in enumerate(local):
            if nbytes > 0:
                st = ctx.state_bytes(nbytes, 1)
                acc[i][3] -= sum(st[k] for k in sharded) * (1.0 - 1.0 / experts.ep)
    if fsdp_over_ep:
        # FSDP over dp x ep instead of dp and an all-reduce over ep: each unit's all-gathers and
        # reduce-scatter span ep too (priced as the ep stage of a hierarchical collective, on the
        # unit's 1/dp shard), one all-gather of the re-gather a pipeline does; the optimizer steps
        # 1/ep of the elements it stepped. At dp 1 that is FSDP over ep alone (the runtime's
        # fully_shard over the dp x ep ranks), in the gradients' reduce dtype as at dp > 1
        for i, nbytes in enumerate(local):
            if nbytes <= 0:
                continue
            b = int(nbytes / fsdp)
            ep_part = [Collective("all_gather", "forward", b, 1, experts.ep_dim),
                       Collective("all_gather", "backward", b, 1, experts.ep_dim),
                       Collective("reduce_scatter", "backward", int(b * ctx.reduce_scale), 1, experts.ep_dim)]
            acc[i][5] += ctx.comm_time(ep_part, latency=False)
            acc[i][6] += ctx.comm_time(ep_part[:1], latency=False)
            acc[i][7] -= ctx.optimizer_time(0, ctx.optimizer_elements(nbytes, 1), True) * (1.0 - 1.0 / experts.ep)
        return True
    for i, nbytes in enumerate(local):
        if nbytes <= 0:
            continue
        if mode == "zero1":
            # ZeRO-1 over dp x ep: the ep stage of its reduce-scatter and all-gather (on the unit's
            # 1/dp slice, after backward), and 1/ep of the optimizer step
            b = int(nbytes / ctx.dp)
            ep_part = [Collective("reduce_scatter", "backward", int(b * ctx.reduce_scale), 1, experts.ep_dim),
                       Collective("all_gather", "backward", b, 1, experts.ep_dim)]
            acc[i][7] += ctx.comm_time(ep_part, latency=False)
            acc[i][7] -= ctx.optimizer_time(0, ctx.optimizer_elements(nbytes, 1), True) * (1.0 - 1.0 / experts.ep)
        else:
            acc[i][7] += ctx.collective_time(Collective("all_reduce", "backward", int(nbytes / fsdp), 1,
                                                        experts.ep_dim), latency=False)
    if names:   # the calls' latency, once per step
        calls = 2 if mode == "zero1" else 1
        acc[0][7] += calls * ctx.collective_time(Collective("all_reduce", "backward", 1, 1, experts.ep_dim))
    return False


def experts_split(options: Sequence, blocks: Sequence, groups: Sequence, tp: int) -> dict[str, int]:
    """The MoE groups whose experts the TP solution split over tp (its ``<block id>/moe`` option
    sharded: experts_tp), by pattern, with that degree -- what :func:`add_expert_compute` prices
    split; the rest stay whole."""
    split = {o.slot.rsplit("/", 1)[0] for o in options if o.slot.endswith("/moe") and o.strategy.compute_shard != 1}
    spans = [(blk.prefix, set(blk.indices)) for blk in blocks if blk.id in split]
    return {g.pattern: tp for g in groups if any(g.block_prefix == p and set(g.indices) <= ix for p, ix in spans)}


def add_expert_compute(acc: list[list[float]], names: list[str], groups: Sequence, ctx, *, tokens: int,
                       dtype_bytes: int, etp: dict[str, int] | None = None,
                       runtime: ExpertRuntime = OUR_EXPERT_RUNTIME) -> None:
    """Experts on a mesh without ep: reprice each MoE layer's experts, which the TP search counted
    as the captured ops of its block (whole, or split over tp where ``etp`` names the group's
    pattern with its degree: the experts_tp option), as :func:`experts.search.grouped_expert_time`
    prices them (grouped GEMMs at their per-expert shape, the routing glue by its traffic).
    ``tokens``: one micro-batch's tokens on this rank. (With ep > 1 :func:`add_ep` does this for
    its options.)"""
    index = {n: i for i, n in enumerate(names)}
    for g in groups:
        owner = g.pattern[: -len(g.rel) - 1]
        units = [index[u] for u in owner_units(owner, g.block_prefix, g.indices) if u in index]
        if not units:
            continue
        t = (etp or {}).get(g.pattern, 1)
        new = expert_time(ctx, g, tokens=tokens, dtype_bytes=dtype_bytes, ep=1, etp=t, runtime=runtime)
        per_unit = (new - ctx.compute_time(g.work, t)) * g.count / len(units)
        extra = per_unit / 3 if ctx.checkpoint_blocks else 0.0   # the recomputed forward
        for i in units:
            acc[i][0] += per_unit / 3
            acc[i][1] += per_unit / 3 + extra
            acc[i][2] += per_unit / 3
