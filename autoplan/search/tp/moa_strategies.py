"""Strategies for a mixture of attention heads (capture.moa_roles: JetMoE's MoA) on a
tensor-parallel mesh.

The unit: a router (E outputs) picks top-k of E attention experts per token; each expert's query
projection (a stacked (E, D, H) weight) makes the token copy's D = KV heads x head width query
columns, a K/V projection shared by all experts makes the keys and values, the core runs on the
top-k copies' heads, and each expert's output projection ((E, H, D)) maps back, gated and summed.

Sharded as Megatron shards an attention, by heads: every rank keeps the router (whole, so every
rank routes the same tokens) and, of every expert, the query and output columns of its share of
the KV heads (PairedExpertsParallel on the experts container, ``head_dim`` keeping heads whole),
and those heads' columns of the K/V projection (ColwiseParallel, [k|v] packed). The query
experts' input is copied into the split (its gradient all-reduced in backward), the output
experts' partial rows all-reduced in forward before the gates and the bias, and the K/V
projection, which reads the module's plain input, all-reduces its input gradient in backward.
Head counts and widths the module stores are made local (PrepareHeadsInput on the module, the
container's own width by the experts' style). With square expert weights (D == H) the shapes
cannot tell which dimension is the heads' width: the ``F.linear`` orientation comes first and
the other is its fallback, the probe rejecting the one the module's code does not run with.

On a sequence-sharded stream (S) the module is a gathered region (``GatheredRegion``, as an MoE
container is): its input gathered to the whole sequence, the stream's shard sliced out of the
first of its tuple outputs. Inside, every form runs as on R; the sharded one's head counts are
made local by the region itself (the module's one style), not by ``PrepareHeadsInput``.
"""
from __future__ import annotations

from hyper_parallel import ColwiseParallel, PrepareHeadsInput, Replicate
from hyper_parallel.core.collective import Collective
from hyper_parallel.core.expert_parallel import PairedExpertsParallel
from hyper_parallel.core.tensor_parallel.sequence_region import GatheredRegion

from autoplan.search.tp.strategies import Strategy, _replicated_region_on_s
from autoplan.search.units.structure import AttentionUnit, BlockGroupInfo

R = Replicate()


def moa_strategies(a: AttentionUnit, blk: BlockGroupInfo, t: int, layout: str) -> list[Strategy]:
    """Replicated, or the heads sharded over tp (when tp divides the KV heads); on S inside a
    gathered region."""
    m = a.moa
    h = blk.hidden_bytes
    region = _replicated_region_on_s(h) if layout == "S" else []
    if layout == "S":
        out = [Strategy("replicate", "S", {a.rel: GatheredRegion(sequence_dim=1)}, list(region),
                        reason="mixture of attention heads replicated on the gathered sequence")]
    else:
        out = [Strategy("replicate", "R", {}, [], reason="mixture of attention heads replicated")]
    if t == 1:
        return out
    kv, n = a.n_kv_heads, a.n_heads
    if kv % t:
        out[0].extra["tp_excluded"] = (f"KV heads {kv} (each of the top-{m['top_k']} experts' query heads per "
                                       f"token: {kv}, {n} in the core) not divisible by tp={t} (whole heads per "
                                       f"rank)")
        return out
    rows = h * m["top_k"]
    comm = region + [Collective("all_reduce", "forward", rows), Collective("all_reduce", "backward", rows)] \
        + [Collective("all_reduce", "backward", h) for _ in m["kv"]]
    # the router and the bias stay whole; the rest is t ways
    whole = m["num_experts"] * m["hidden"] + m["hidden"]
    total = max(a.work.params, whole + 1)
    param_shard = total / (whole + (total - whole) / t)
    # per token, whole: the input, its top-k copies into the query experts and out of the output
    # experts ((1 + 2k) H); split: the copies' queries and core outputs, keys and values ((2k + 2) D)
    k, width, hid = m["top_k"], m["width"], m["hidden"]
    split, kept = (2 * k + 2) * width, (1 + 2 * k) * hid
    activation_shard = (split + kept) / (split / t + kept)
    if layout == "S":
        prep = {a.rel: GatheredRegion(sequence_dim=1, local_attributes=sorted(a.head_attrs) or None)}
    else:
        prep = {a.rel: PrepareHeadsInput(input_layouts=(R,), desired_input_layouts=(R,), use_local_output=True,
                                         local_attributes=sorted(a.head_attrs))} if a.head_attrs else {}
    kv_cols = {p: ColwiseParallel(packed=m["kv_packed"]) for p in m["kv"]}
    dims = list(zip(m["up_dims"], m["down_dims"]))
    local = f"; the module's {', '.join(sorted(a.head_attrs))} made local" if a.head_attrs else ""
    previous = None
    for i, (up_dim, down_dim) in enumerate(dims):
        experts = PairedExpertsParallel(up=m["up"], down=m["down"], up_dim=up_dim, down_dim=down_dim,
                                        weight=m["weight"], head_dim=a.head_dim,
                                        local_attributes=m["local_attributes"] or None)
        name = "heads_sharded" if i == 0 else f"heads_sharded_dims{up_dim}{down_dim}"
        out.append(Strategy(
            name, layout, {**prep, m["experts"]: experts, **kv_cols}, list(comm), compute_shard=t,
            param_shard=param_shard, activation_shard=activation_shard,
            reason=f"mixture of attention heads{' on the gathered sequence' if region else ''}: the {kv} KV heads "
                   f"({n} in the core) sharded over tp -- every "
                   f"expert's query columns (dim {up_dim}) and output rows (dim {down_dim}) and the K/V "
                   f"projection's columns of each rank's heads; router replicated{local}",
            extra={"fallback_for": previous} if previous else {}))
        previous = name
    return out
