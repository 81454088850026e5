"""The price of context parallelism in a plan on a fixed mesh: compute, memory, the attention exchange.

What cp changes, and how each part is priced (the plan's notes repeat it):

- tokens: the model is captured at this rank's share, ``(global_batch / dp, seq_len / cp)`` tokens,
  so every per-token op (projections, MLP, norms, the LM head), its saved activations and the
  tensor-parallel collectives are already those of one cp rank -- activation memory is / cp;
- attention: the captured graph's score GEMMs see ``seq/cp`` keys, but a cp rank's queries attend
  to the whole (causal) sequence: with the load-balanced layout each rank does 1/cp of the causal
  work, which is ``cp`` times the local graph's causal work. ``cp_structure`` multiplies the
  attention core's GEMM FLOPs by cp (RoPE and reshapes stay per-token);
- exchange: the collectives come from the runtime itself (``predicted_collectives``), priced with
  cost_models on the cp dimension's link. The ring overlaps each message with one block of
  attention (the runtime starts the next exchange before computing on the current shard), so it is
  priced *exposed-only*, step by step: forward ``(cp-1) * max(0, t_msg - t_blk_fwd)``, backward
  ``(cp-1) * max(0, 2 t_msg - t_blk_bwd)`` + the last gradient message (nothing left to hide it),
  with ``t_blk`` the attention core's time per block (1/cp of the layer's core; forward a third,
  backward two thirds of forward + backward). The all-gather is not overlapped: its all-gather
  and reduce-scatter are exposed whole. Full recomputation repeats the forward exchange in
  backward. The variant with the smaller exposed time that fits memory wins (all-gather keeps
  the whole sequence's K/V of every layer saved: ``(cp-1)`` shards more per layer);
- the loss: ``cp_cross_entropy`` all-reduces (sum, count) in float64 over the gradient mesh: 16 B.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autoplan.parallelisms.data import flat_name
from autoplan.search.pricing.costing import CostContext
from autoplan.search.units.structure import ModelStructure
from autoplan.search.units.work import Work
from cost_models.topology import MeshTopology, mesh_topology
from hyper_parallel.core.collective import Collective
from hyper_parallel.core.context_parallel import VARIANTS, kv_shard_bytes, predicted_collectives
from hyper_parallel.parallel_dims import ParallelDims

OVERLAP_NOTE = ("context parallel: the ring exchange is priced as overlapped with the attention blocks (exposed "
                "only: per ring step max(0, message - block compute)); the all-gather variant as not overlapped; "
                "per-token work and activations are those of seq/cp tokens, attention compute is 1/cp of the causal "
                "total (load-balanced head+tail chunks)")
LOSS_BYTES = 16   # cp_cross_entropy: (sum, count) in float64, all-reduced once per step


def grad_dims(spec: ParallelDims) -> tuple[str, ...]:
    """The mesh dimensions gradients are averaged over under cp: dp (if any), then cp (the
    planner's view of ``autoplan.parallelisms.data.grad_dims``, from a mesh instead of a plan)."""
    return tuple(spec.dim(r) for r in ("dp", "cp") if spec.dim(r) is not None)


def cp_topology(spec: ParallelDims) -> MeshTopology:
    """The mesh's links plus the flattened dp x cp dimension FSDP runs on (named "dp_cp", priced
    as a dimension of the mesh with dp and cp merged)."""
    topo = mesh_topology(spec)
    dims = grad_dims(spec)
    if len(dims) < 2:
        return topo
    i = spec.names.index(dims[0])
    shape = spec.shape[:i] + (spec.shape[i] * spec.shape[i + 1],) + spec.shape[i + 2:]
    names = spec.names[:i] + ("dp",) + spec.names[i + 2:]
    merged = mesh_topology(ParallelDims(shape, names, spec.hardware, spec.devices_per_node))["dp"]
    return MeshTopology(topo.dims + (dataclasses.replace(merged, name=flat_name(dims)),))


def cp_structure(structure: ModelStructure, cp: int) -> ModelStructure:
    """``structure`` (captured at seq/cp tokens) with each attention core's score GEMMs doing cp
    times the work: one cp rank's share of the causal attention over the whole sequence."""
    if cp <= 1:
        return structure
    blocks = []
    for b in structure.blocks:
        a = b.attention
        if a is None or a.work.core is None or not a.work.core.gemms:
            blocks.append(b)
            continue
        core = a.work.core
        gemm_flops = sum(g[0] for g in core.gemms)
        extra = gemm_flops * (cp - 1)
        gemms = tuple((g[0] * cp, *g[1:]) for g in core.gemms)
        new_core = dataclasses.replace(core, flops=core.flops + extra, gemms=gemms)
        own = a.work
        new_work = dataclasses.replace(own, flops=own.flops + extra, core=new_core,
                                       gemms=tuple((g[0] * cp, *g[1:]) if g in core.gemms else g for g in own.gemms))
        blocks.append(dataclasses.replace(b, attention=dataclasses.replace(a, work=new_work)))
    return dataclasses.replace(structure, blocks=blocks)


@dataclass
class CPChoice:
    """The priced context-parallel decision: the variant, its rows, seconds and extra memory."""

    variant: str
    dim: str
    degree: int
    collectives: list[Collective]
    exchange_s: float              # the attention exchange of one step, all layers
    exposed_s: float               # the part compute does not hide (added to the step)
    extra_memory: float            # bytes per rank beyond the captured activations (all-gather's K/V)
    candidates: dict[str, dict] = field(default_factory=dict)
    exposed_forward_s: float = 0.0  # the forward pass's part of exposed_s (a pipeline times passes apart)

    def section(self) -> dict:
        """The plan's ``parallel.cp`` section."""
        return {"dim": self.dim, "variant": self.variant, "degree": self.degree, "exchange_s": self.exchange_s,
                "exposed_s": self.exposed_s}


def _head_dim(graph, block, attention) -> int:
    """One head's width: what capture read (``AttentionUnit.head_dim``), else the key projection's
    output over the KV heads -- halved when k and v are one fused [k|v] projection."""
    if attention.head_dim:
        return int(attention.head_dim)
    m = graph.modules.get(f"{block.representative}.{attention.k}") if attention.k else None
    w = (m.params.get("weight") if m else None)
    parts = 2 if attention.k and attention.k == attention.v else 1
    if w and attention.n_kv_heads and w[0] % (parts * attention.n_kv_heads) == 0:
        return int(w[0] // (parts * attention.n_kv_heads))
    return int(attention.head_attrs.get("head_dim") or block.dim // attention.n_heads)


@dataclass(frozen=True)
class CPShape:
    """One rank's share of a context-parallel step: what pricing the exchange needs beside the
    model and its tensor-parallel choice."""

    cp: int              # the context-parallel degree
    cp_dim: str          # its mesh dimension
    loss_dim: str        # where the loss's partial sums are reduced (dp, or dp x cp flattened)
    local_batch: int     # sequences one forward runs on a rank
    seq_len: int         # the whole sequence (each rank holds 2 of its 2*cp chunks)
    dtype_bytes: int
    tp: int              # the tensor-parallel degree (K/V heads split over it)


def price_cp(structure: ModelStructure, graph, ctx: CostContext, chosen: dict, shape: CPShape, *,
             memory_left: float, variants=None) -> CPChoice:
    """Price both variants for the chosen tensor-parallel options and pick the cheaper one that
    fits ``memory_left`` bytes (ring when neither does: it adds nothing)."""
    cp, cp_dim, loss_dim, local_batch, seq_len, dtype_bytes, tp = dataclasses.astuple(shape)
    cands = {}
    for variant in sorted(variants or VARIANTS):   # ``variants``: restrict (a choice already made)
        rows, exchange, exposed, extra, exposed_fwd = [], 0.0, 0.0, 0.0, 0.0
        for b in structure.blocks:
            a = b.attention
            if a is None:
                continue
            opt = chosen.get(f"{b.id}/attention")
            shard = opt.strategy.compute_shard if opt is not None else 1
            tp_kv = tp if shard > 1 else 1
            kw = dict(batch=local_batch, seq_len=seq_len, n_kv_heads=a.n_kv_heads, head_dim=_head_dim(graph, b, a),
                      cp=cp, tp=tp_kv, dtype_bytes=dtype_bytes)
            kv = kv_shard_bytes(**kw)
            layer = predicted_collectives(variant=variant, **kw, dim=cp_dim)
            if ctx.checkpoint_blocks:   # the recomputed forward exchanges again in backward
                layer += [Collective(c.kind, "backward", c.nbytes, c.count, c.dim) for c in layer
                          if c.phase == "forward"]
            rows += [c.scaled(b.count) for c in layer]
            core = a.work.core or Work()
            t_core = ctx.compute_time(core, shard) if core.flops else 0.0
            recompute = 1 if ctx.checkpoint_blocks else 0
            if variant == "ring":
                t_msg = ctx.collective_time(Collective("send_recv", "forward", kv, 1, cp_dim))
                blk_f, blk_b = t_core / 3 / cp, 2 * t_core / 3 / cp
                fwd = (cp - 1) * max(0.0, t_msg - blk_f)
                bwd = (cp - 1) * max(0.0, 2 * t_msg - blk_b) + t_msg
                layer_exchange = (3 * cp - 2 + recompute * (cp - 1)) * t_msg
                layer_exposed = fwd * (1 + recompute) + bwd
                layer_fwd = fwd
                layer_extra = 0.0
            else:
                layer_exchange = sum(ctx.collective_time(c) for c in layer)
                layer_exposed = layer_exchange
                layer_fwd = sum(ctx.collective_time(c) for c in layer if c.phase == "forward")
                layer_extra = kv * (cp - 1)
            exchange += b.count * layer_exchange
            exposed += b.count * layer_exposed
            exposed_fwd += b.count * layer_fwd
            extra += (1 if ctx.checkpoint_blocks else b.count) * layer_extra
        rows.append(Collective("all_reduce", "forward", LOSS_BYTES, 1, loss_dim))
        cands[variant] = {"collectives": rows, "exchange_s": exchange, "exposed_s": exposed, "extra_memory": extra,
                          "exposed_forward_s": exposed_fwd}
    fits = [v for v in cands if cands[v]["extra_memory"] <= memory_left] or (["ring"] if "ring" in cands else list(cands))
    best = min(fits, key=lambda v: (cands[v]["exposed_s"], v != "ring"))
    c = cands[best]
    summary = {v: {"exchange_s": d["exchange_s"], "exposed_s": d["exposed_s"], "extra_memory": d["extra_memory"],
                   "exposed_forward_s": d["exposed_forward_s"]}
               for v, d in cands.items()}
    return CPChoice(best, cp_dim, cp, c["collectives"], c["exchange_s"], c["exposed_s"], c["extra_memory"], summary,
                    c["exposed_forward_s"])

