"""Candidate tensor-parallel strategies per unit, each with the exact collectives it issues.

A strategy is what a plan author would write for one unit (attention, MLP, norms, embedding,
LM head) given the layout of the residual stream around it: R (replicated) or S (sharded on the
sequence, i.e. sequence parallel). Its collectives are those hyper_parallel really issues for
that style combination on DTensor (checked by CollectiveRecorder in tests/verify), so that a
plan's predicted collectives can be compared with the issued ones exactly.

Bytes follow cost_models' convention: the full logical tensor (gathered / pre-scatter / reduced).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hyper_parallel.core.collective import Collective
from hyper_parallel import (
    ColwiseParallel,
    HeadColsParallel,
    HeadRowsParallel,
    KVReplicatedParallel,
    ParallelStyle,
    PrepareHeadsInput,
    PrepareLatentInput,
    PrepareModuleInput,
    PrepareModuleOutput,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
)

from autoplan.search.units.structure import AttentionUnit, BlockGroupInfo, EmbeddingInfo, HeadInfo, MlpUnit

R, S = Replicate(), Shard(1)
LAYOUTS = ("R", "S")
_PLACEMENT = {"R": R, "S": S}
# loss parallel all-reduces, per token: the max and the sum of exponentials in fp32, then the
# target logit in the logits' dtype
LOSS_FP32_REDUCTIONS = 2


@dataclass
class Strategy:
    """One choice for one unit. ``shard`` divides its compute and parameter bytes; ``styles``
    maps module paths (relative to the unit's owner: block or model root) to styles."""

    name: str
    stream: str | None                      # the residual-stream layout it needs (None: any)
    styles: dict[str, ParallelStyle]
    collectives: list[Collective]
    compute_shard: float = 1     # tp, or vocab / ceil(vocab / tp) for an uneven shard (uneven_shard)
    param_shard: float = 1
    activation_shard: float = 1.0
    reason: str = ""
    extra: dict = field(default_factory=dict)
    # compute_shard cuts the tokens (per-token work on a sequence shard), not the weights' N or K
    split_tokens: bool = False


def uneven_shard(n: int, t: int) -> float:
    """What a tensor-parallel degree ``t`` divides ``n`` rows by on the fullest rank. DTensor cuts a
    dimension in chunks of ceil(n / t) (torch.chunk: 130 over 4 is 33, 33, 33, 31), so the step
    waits for a rank with ceil(n / t) rows: the shard is n / ceil(n / t), t when t divides n."""
    return t if n % t == 0 else n / math.ceil(n / t)


def _uneven(what: str, n: int, t: int) -> dict:
    """The plan's word on an uneven unit (empty when t divides n)."""
    if n % t == 0:
        return {}
    return {"uneven": f"{what} {n} over tp={t}: {math.ceil(n / t)} on the fullest rank "
                      f"({math.ceil(n / t) * t / n - 1:.1%} more work than an even split)"}


def _ag_rs_pair(nbytes: int) -> list[Collective]:
    """Enter a tensor-parallel region from S and leave it to S (one all-gather + reduce-scatter
    each way)."""
    return [Collective("all_gather", "forward", nbytes), Collective("reduce_scatter", "forward", nbytes),
            Collective("reduce_scatter", "backward", nbytes), Collective("all_gather", "backward", nbytes)]


def _ar_pair(nbytes: int) -> list[Collective]:
    """Megatron's f/g: all-reduce the output in forward, the input gradient in backward."""
    return [Collective("all_reduce", "forward", nbytes), Collective("all_reduce", "backward", nbytes)]


def _replicated_region_on_s(nbytes: int) -> list[Collective]:
    """Compute replicated while the stream is sequence-sharded: gather in, slice out."""
    return [Collective("all_gather", "forward", nbytes), Collective("all_gather", "backward", nbytes)]


def _gathered_region(container: str, last: str) -> dict[str, ParallelStyle]:
    """A replicated unit on a sequence-sharded stream: the sequence gathered at the unit's input,
    the stream's shard sliced out of its last projection's output. The output is taken at the
    projection, not at the container, whose return value may be a tuple (HF attention returns
    its weights beside the output). Two modules, not ``GatheredRegion`` on one: the projection
    need not sit inside the module the stream enters (BERT's ``attention.output.dense`` beside its
    entry ``attention.self``)."""
    return {container: PrepareModuleInput(input_layouts=(S,), desired_input_layouts=(R,), use_local_output=True),
            last: PrepareModuleOutput(output_layouts=(R,), desired_output_layouts=(S,), use_local_output=True)}


def _grad_all_reduces(param_bytes: list[int]) -> list[Collective]:
    """One all-reduce per replicated parameter whose gradient comes out Partial (SP regions)."""
    return [Collective("all_reduce", "backward", b, weight_grad=True) for b in param_bytes]


# FSDP2 shards a packed (strided) weight on its other dimension; a 1-D bias has none, so FSDP
# leaves it replicated and the runner all-reduces its gradient over dp
# (hyper_parallel.core.dtensor.fsdp_unshardable). Under FSDP mixed precision that bias would stay
# in fp32 beside bf16 weights: the cluster search, which always casts, does not offer it then.
PACKED_BIAS = "fsdp_replicated_bias"


def _column_styles(a: AttentionUnit, t: int) -> tuple[dict[str, ParallelStyle], str, dict] | str:
    """The column-parallel styles that give each rank whole heads of q, k and v, the reason and
    extra, or why there are none. Separate q/k/v: each column-wise. A fused projection whose
    output is cut into groups (GPT-NeoX, Bloom: per head; Falcon: per KV group): plain
    column-wise, a contiguous row block holds whole groups. A fused [q|k|v] of equal widths
    (GPT-2): each rank's slice of every part (packed=3). The module's own code must then cut its
    local output by the local head count; the probe rejects a candidate whose code uses the
    global count (a crash), and the layout read from the graph keeps a candidate from being
    offered where it would run and be silently wrong (packed rows on an interleaved layout)."""
    if not a.qkv:
        return ({a.q: ColwiseParallel(), a.k: ColwiseParallel(), a.v: ColwiseParallel()},
                "q/k/v column-wise, o row-wise (Megatron)", {})
    if a.qkv_layout == "interleaved":
        if a.qkv_groups % t:
            return f"fused q/k/v in {a.qkv_groups} groups not divisible by tp={t}"
        return ({a.qkv: ColwiseParallel()},
                f"fused q/k/v column-wise in whole groups ({a.qkv_groups} groups of interleaved q, k, v), "
                f"o row-wise", {})
    if a.qkv_layout == "concat":
        if a.n_heads != a.n_kv_heads:
            return "a fused [q|k|v] with fewer KV heads than query heads (unequal widths) is not sharded"
        return ({a.qkv: ColwiseParallel(packed=3)},
                "fused [q|k|v] column-wise, each rank its slice of q, k and v (strided), o row-wise",
                {PACKED_BIAS: "packed q/k/v projection's bias"} if a.qkv_bias else {})
    return "the fused q/k/v projection's output layout was not recognised"


def attention_strategies(a: AttentionUnit, blk: BlockGroupInfo, t: int, layout: str) -> list[Strategy]:
    h = blk.hidden_bytes
    inp = (_PLACEMENT[layout],)
    if not a.rel:
        return [Strategy("replicate", "R", {}, [], reason="replicated (projections sit directly in the block)")] \
            if layout == "R" else []
    out = [Strategy("replicate", layout, {}, [], reason="replicated heads")]
    if layout == "S":
        out[0] = Strategy("replicate", "S", _gathered_region(a.entry or a.rel, a.o), _replicated_region_on_s(h),
                          reason="replicated heads on the gathered sequence")
    why = None
    if t == 1:
        why = "tp degree 1"
    elif not a.linear:
        why = "projections are not nn.Linear or Conv1D"
    elif a.n_heads % t or a.n_kv_heads % t:
        why = f"heads {a.n_heads} / KV heads {a.n_kv_heads} not divisible by tp={t} (KV heads kept whole)"
        if a.n_heads % t:   # query heads too: no even split of them exists
            why += (f"; DTensor's Shard cuts a dimension into {t} equal torch.chunk pieces, which would split "
                    f"heads, and a head-aligned uneven split has no DTensor placement")
    if a.broadcast:   # a latent attention (MLA): its own form, with plain inputs
        if why is None and len(a.broadcast) != 1:
            why = f"{len(a.broadcast)} projections broadcast to every head (one is planned)"
        if why is None:
            out.append(_latent_heads(a, h, t, layout))
        else:
            out[0].extra["tp_excluded"] = why
        return out
    if why is not None and t > 1 and a.linear and a.n_heads % t and a.n_heads == a.n_kv_heads:
        uneven = _uneven_heads(a, blk, t, layout)
        if isinstance(uneven, Strategy):
            out.append(uneven)
        else:
            why = f"{why}; {uneven}"
    if why is not None and t > 1 and a.linear and a.n_heads % t == 0 and a.n_kv_heads % t:
        kv = _kv_replicated(a, blk, t, layout)
        if isinstance(kv, Strategy):
            out.append(kv)
        else:
            why = f"{why}; {kv}"
    column = _column_styles(a, t) if why is None else why
    if isinstance(column, str) and why is None and a.qkv and a.qkv_layout == "concat" and \
            a.n_heads != a.n_kv_heads:
        # a fused [q|k|v] of unequal widths (DBRX's Wqkv): each rank computes its heads' rows of it
        kv = _kv_replicated(a, blk, t, layout)
        if isinstance(kv, Strategy):
            out.append(kv)
        else:
            column = f"{column}; {kv}"
    if isinstance(column, str):
        why = column
    plain_why = why
    if why is None and a.fixed_head_count:
        plain_why = "q/k/v are reshaped by the global head count with another dimension inferred (a column " \
                    "shard would fold heads into the sequence, silently)"
    if why is None and a.folded_heads:
        plain_why = "it receives per-head tensors folded into the batch dimension (e.g. an ALiBi bias), which " \
                    "must be cut to the rank's heads"
    if why is None:
        cols, reason, extra = column
        # a cross-attention's k and v (or fused kv) projections each annotate the encoder's states
        # themselves (the module's input layouts cover its first input only): one backward
        # all-reduce of those states per projection
        kv_cols = [p for p in cols if p != a.q] if a.kv_input_bytes else []
        kv_grads = [Collective("all_reduce", "backward", a.kv_input_bytes) for _ in kv_cols]
        comm = (_ag_rs_pair(h) if layout == "S" else _ar_pair(h)) + kv_grads
        rows = {**cols, a.o: RowwiseParallel(output_layouts=_PLACEMENT[layout])}
        if a.bias_table:   # each rank's heads' columns of the per-head bias table (T5)
            rows[a.bias_table] = ColwiseParallel()
        if plain_why is None:
            out.append(Strategy("heads_sharded", layout, {**_heads_prep(a, a.entry or a.rel, inp), **rows},
                                comm, compute_shard=t, param_shard=t, activation_shard=t, reason=reason,
                                extra=dict(extra)))
        if a.head_attrs:
            # the same shards for code that cuts by the head counts it stores (Phi-3, StableLM,
            # Bloom, OPT): offered where the plain form fails its probe run or cannot be used
            counts = ", ".join(sorted(a.head_attrs))
            out.append(Strategy("heads_sharded_local", layout,
                                {**_heads_prep(a, a.rel, inp, local_attributes=sorted(a.head_attrs),
                                               folded_heads=a.folded_heads or None), **rows},
                                comm, compute_shard=t, param_shard=t, activation_shard=t,
                                reason=f"{reason}; the module's {counts} set to their local values" +
                                       (f"; per-head inputs folded into the batch cut by {a.folded_heads}"
                                        if a.folded_heads else ""),
                                extra={**extra, "fallback_for": "heads_sharded"}))
        if plain_why is None and layout == "R":
            # the same shards with the module's inputs left plain tensors: for attention that
            # also adds its input to its output inside the module (BERT's post-norm residual in
            # BertSelfOutput: a DTensor input would meet the plain projection output there). Each
            # column-parallel projection then reduces its own input gradient in backward.
            out.append(Strategy("heads_sharded_plain_input", "R", {**_heads_prep(a, a.rel, None), **rows},
                                [Collective("all_reduce", "forward", h)] +
                                [Collective("all_reduce", "backward", h) for p in cols if p not in kv_cols] + kv_grads,
                                compute_shard=t, param_shard=t, activation_shard=t,
                                reason=f"{reason}; inputs stay plain tensors (the module adds its input to its "
                                       "output)", extra={**extra, "fallback_for": "heads_sharded"}))
    if plain_why is not None:
        out[0].extra["tp_excluded"] = plain_why
    return out


def _heads_prep(a: AttentionUnit, at: str, inp: tuple | None, **local) -> dict:
    """{module: style} that readies attention ``a`` for sharded heads: the stream's input layouts
    at ``at`` (the module, or its entry inside it; ``inp`` None: inputs left plain), the integer
    attributes ``local`` names made local there, and the per-head parameters the module holds
    itself (``a.head_params``: GPT-OSS's sinks) sharded with its heads on the module."""
    layouts = {} if inp is None else dict(input_layouts=inp, desired_input_layouts=(R,))
    local = {k: v for k, v in local.items() if v}
    own = {"head_params": list(a.head_params)} if a.head_params else {}
    heads = {**local, **(own if at == a.rel else {})}   # what only PrepareHeadsInput does, at ``at``
    out = {}
    if layouts or heads:
        out[at] = PrepareHeadsInput(**layouts, **heads) if heads else PrepareModuleInput(**layouts)
    if own and at != a.rel:   # the module holds its head parameters itself, its entry is inside it
        out[a.rel] = PrepareHeadsInput(**own)
    return out


def _kv_replicated(a: AttentionUnit, blk: BlockGroupInfo, t: int, layout: str) -> Strategy | str:
    """Query heads sharded, K/V projections whole on every rank (Megatron's and HF's form for
    multi-query attention): q column-wise -- or, in a fused [q|k|v], its q columns -- with the
    module's query head counts and widths made local; K/V's weights replicated, their gradients
    (partial: each rank's heads' share) all-reduced in backward. With several KV heads (GQA with
    fewer KV heads than ranks) it needs tp a multiple of the KV heads, so that each rank's query
    heads read one KV head: the rank computes that head only (KVReplicatedParallel's ``kv_heads``)
    and the module's query-heads-per-KV-head count shrinks by tp / KV heads. A fused [q|k|v] of
    unequal widths (DBRX) whose KV heads tp divides takes the same form, each rank computing its
    rows of q and its KV heads' rows of k and v from the projection kept whole: compute sharded,
    that projection's parameters not."""
    n, kv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    if t % kv and kv % t:
        return f"kv-replicated attention needs tp={t} a multiple or a divisor of the {kv} KV heads (each rank's " \
               f"query heads reading whole KV heads)"
    local = sorted([k for k, v in a.head_attrs.items() if v in (n, n * hd) and v not in (kv, kv * hd)]
                   + list(a.group_attrs))
    divisors = {}
    if kv % t == 0:
        # KV heads divide tp (a fused [q|k|v] of unequal widths): each rank kv / t of them, the
        # query heads per KV head unchanged
        local = sorted({k for k, v in a.head_attrs.items() if v in (n, n * hd, kv, kv * hd)})
    elif kv > 1:
        # each rank keeps one KV head: groups shrink by t / kv, KV head counts and widths by kv
        kv_attrs = sorted(k for k, v in a.head_attrs.items() if v in (kv, kv * hd) and v not in (n, n * hd))
        local = sorted(set(local) | set(kv_attrs))
        divisors = {**{k: t // kv for k in a.group_attrs}, **{k: kv for k in kv_attrs}}
        divisors = {k: d for k, d in divisors.items() if d != t}
    whole = kv if kv > 1 else None
    if a.qkv:
        if a.qkv_layout != "concat" or not hd:
            return "kv-replicated attention needs a fused projection cut as [q|k|v]"
        if not local:
            return "the fused [q|k|v] is cut by widths the module does not hold as attributes"
        cols = {a.qkv: KVReplicatedParallel(fused_heads=[n, 2 * kv], kv_heads=whole)}
    else:
        if 1 < kv < t and not a.group_attrs:
            return f"the module holds no count of query heads per KV head to make local ({kv} KV heads)"
        cols = {a.q: ColwiseParallel(), a.k: KVReplicatedParallel(kv_heads=whole),
                a.v: KVReplicatedParallel(kv_heads=whole)}
    inp, h = (_PLACEMENT[layout],), blk.hidden_bytes
    prep = _heads_prep(a, a.rel, inp, local_attributes=local, attribute_divisors=divisors or None)
    per_param = a.work.param_bytes / a.work.params if a.work.params else 4
    whole_params = sum(a.kv_params)
    total = max(a.work.params, whole_params + 1)
    param_shard = total / (whole_params + (total - whole_params) / t)
    comm = (_ag_rs_pair(h) if layout == "S" else _ar_pair(h)) + \
        [Collective("all_reduce", "backward", int(p * per_param), weight_grad=True) for p in a.kv_params]
    form = "Megatron's multi-query form" if kv == 1 else "each rank computing the one KV head its query heads read" \
        if kv < t else f"each rank computing its {kv // t} of them from the fused projection kept whole"
    return Strategy("kv_replicated", layout, {**prep, **cols, a.o: RowwiseParallel(output_layouts=_PLACEMENT[layout])},
                    comm, compute_shard=t, param_shard=param_shard, activation_shard=t,
                    reason=f"query heads ({n}) sharded, the {kv} KV head{'s' if kv > 1 else ''} replicated with "
                           f"their gradients all-reduced ({form})" + (f"; the module's {', '.join(local)} made local"
                                                                      if local else ""))


def _uneven_heads(a: AttentionUnit, blk: BlockGroupInfo, t: int, layout: str) -> Strategy | str:
    """Heads the tp degree does not divide (GPT-2 XL: 25 at tp=4), split whole and unevenly (6, 6, 6,
    7): every projection kept whole and replicated, each rank computing its heads' rows of q, k and
    v and their columns of the output projection (hyper_parallel's HeadRowsParallel /
    HeadColsParallel), the module's head counts and widths made this rank's share (PrepareHeadsInput
    ``head_count``). Compute and activations split by heads -- the fullest rank holds ceil(H / tp) --
    parameters not: every projection weight's gradient (partial: its rank's heads' rows) is
    all-reduced over tp, as is the output bias's on a sequence-sharded stream."""
    n, hd = a.n_heads, a.head_dim
    if n < t:
        return f"{n} heads are fewer than tp={t} ranks (each needs a whole head)"
    extra_inputs = [why for cond, why in ((a.kv_input_bytes, "keys/values read another tensor (cross-attention)"),
                                          (a.bias_table, "a per-head bias table"),
                                          (a.folded_heads, "per-head inputs folded into the batch"),
                                          (a.head_params, "per-head parameters of the module's own")) if cond]
    if extra_inputs:   # each would need its own cut to the rank's uneven heads
        return f"uneven heads are not offered with {extra_inputs[0]}"
    local = sorted(k for k, v in a.head_attrs.items() if v in (n, n * hd)) if hd else []
    if not local:
        return "the module holds no head count or width to make each rank's share (uneven heads)"
    if a.qkv:
        if a.qkv_layout != "concat":
            return "uneven heads need q/k/v as separate projections or one fused [q|k|v]"
        cols = {a.qkv: HeadRowsParallel(sections=[n, n, n])}
    else:
        cols = {a.q: HeadRowsParallel(sections=[n]), a.k: HeadRowsParallel(sections=[n]),
                a.v: HeadRowsParallel(sections=[n])}
    inp, h = (_PLACEMENT[layout],), blk.hidden_bytes
    per_param = a.work.param_bytes / a.work.params if a.work.params else 4
    grads = [Collective("all_reduce", "backward", int(c * per_param), weight_grad=True)
             for name, c in sorted(a.proj_params.items())
             if name.rsplit(".", 1)[0] in cols or (name.rsplit(".", 1)[0] == a.o and
                                                   (name.endswith(".weight") or layout == "S"))]
    # the module's input is made replicated once (PrepareHeadsInput): its gradient, summed over
    # the projections that read it, is reduced once there
    comm = _ag_rs_pair(h) if layout == "S" else _ar_pair(h)
    shard = n / math.ceil(n / t)
    return Strategy("heads_uneven", layout,
                    {a.rel: PrepareHeadsInput(input_layouts=inp, desired_input_layouts=(R,), local_attributes=local,
                                              head_count=n),
                     **cols, a.o: HeadColsParallel(heads=n, output_layouts=_PLACEMENT[layout])},
                    comm + grads, compute_shard=shard, param_shard=1, activation_shard=shard,
                    reason=f"{n} heads split whole over tp={t} ({math.ceil(n / t)} on the fullest rank), every "
                           f"projection kept whole with its gradient all-reduced; the module's "
                           f"{', '.join(local)} made each rank's share",
                    extra=_uneven("heads", n, t))


def _latent_heads(a: AttentionUnit, h: int, t: int, layout: str) -> Strategy:
    """Heads sharded in a latent attention (DeepSeek's MLA; torchtitan's DeepSeek plan shards the
    same modules): the per-head up-projections (q_b_proj or q_proj, kv_b_proj) column-wise, o_proj
    row-wise; the down-projections and their norms stay replicated, computing the latents whole
    on every rank, so the module's inputs stay plain tensors (a DTensor input would meet their
    plain weights) and each column projection all-reduces its latent input's gradient in
    backward. The output columns of the replicated projection that reach the core broadcast to
    every head (the rotary key) get their gradient all-reduced by PrepareLatentInput: a rank sums
    only its own heads' share of it. On a sequence-sharded stream the module gathers the sequence
    at its input (a plain gather: backward slices the whole gradient every rank holds) and o_proj
    reduce-scatters into it."""
    heads = list(dict.fromkeys([a.q, a.k, a.v]))
    (linear, start, stop, nbytes), = a.broadcast
    inside = linear[len(a.rel) + 1:] if linear.startswith(a.rel + ".") else linear
    styles: dict[str, ParallelStyle] = {
        a.rel: PrepareLatentInput(input_layouts=(_PLACEMENT[layout],), desired_input_layouts=(R,), use_local_output=True,
                                  broadcast_linear=inside, broadcast_columns=a.broadcast_columns[linear])}
    styles.update({p: ColwiseParallel() for p in heads})
    styles[a.o] = RowwiseParallel(output_layouts=_PLACEMENT[layout])
    grads = [Collective("all_reduce", "backward", a.proj_input_bytes.get(p, h)) for p in heads] + \
        [Collective("all_reduce", "backward", nbytes)]
    comm = [Collective("all_reduce", "forward", h)] if layout == "R" else \
        [Collective("all_gather", "forward", h), Collective("reduce_scatter", "forward", h),
         Collective("all_gather", "backward", h)]
    # the replicated latent path is not divided: what a rank runs is that share whole, the rest 1/t
    flops, params, saved = (1.0 / (share + (1.0 - share) / t) for share in a.replicated_share)
    return Strategy("heads_sharded_latent", layout, styles, comm + grads, compute_shard=flops, param_shard=params,
                    activation_shard=saved,
                    reason=f"latent attention: per-head up-projections column-wise, o row-wise, latents replicated; "
                           f"gradient of the columns broadcast to every head ({linear}[{start}:{stop}]) all-reduced")


def mlp_strategies(m: MlpUnit, blk: BlockGroupInfo, t: int, layout: str, param_bytes: list[int]) -> list[Strategy]:
    h = blk.hidden_bytes
    inp = (_PLACEMENT[layout],)
    if not m.rel:
        # the linears sit directly in the block (OPT's and XGLM's fc1/fc2): no container to change
        # layouts at. On R the first linear takes the stream as is and the last all-reduces its
        # partial sums back. On S each up linear gathers the sequence at its own input and the
        # down linear reduce-scatters back to the shard, on the dimension the tokens sit on there
        # (0 where the block flattened them: OPT); a replicated MLP on S would need a region no
        # module bounds: none.
        sharded = t > 1 and m.linear and m.hidden and m.packed == 1
        if layout != "R":
            if not sharded:
                return []
            tokens = Shard(m.token_dim)   # a block that flattened its tokens (OPT) has them on dim 0
            styles = {u: ColwiseParallel(input_layouts=tokens) for u in m.up}
            styles[m.down] = RowwiseParallel(output_layouts=tokens)
            k = uneven_shard(m.hidden, t)
            # every up linear gathers the sequence itself (and reduce-scatters its input gradient)
            extra_ups = [c for _ in m.up[1:] for c in (Collective("all_gather", "forward", h),
                                                       Collective("reduce_scatter", "backward", h))]
            return [Strategy("hidden_sharded", "S", styles, _ag_rs_pair(h) + extra_ups, compute_shard=k,
                             param_shard=k, activation_shard=k, extra=_uneven("MLP hidden", m.hidden, t),
                             reason="up/gate column-wise gathering the sequence, down row-wise scattering it "
                                    "(Megatron's sequence parallel), on the linears in the block")]
        out = [Strategy("replicate", "R", {}, [], reason="replicated (MLP linears sit directly in the block)")]
        if sharded:
            styles = {u: ColwiseParallel() for u in m.up}
            styles[m.down] = RowwiseParallel(output_layouts=R)
            k = uneven_shard(m.hidden, t)
            out.append(Strategy("hidden_sharded", "R", styles, _ar_pair(h), compute_shard=k, param_shard=k,
                                activation_shard=k, extra=_uneven("MLP hidden", m.hidden, t),
                                reason="up/gate column-wise, down row-wise (Megatron), on the linears in the block"))
        return out
    if layout == "R":
        out = [Strategy("replicate", "R", {}, [], reason="replicated")]
    else:
        out = [Strategy("replicate", "S", _gathered_region(m.rel, m.down), _replicated_region_on_s(h),
                        reason="replicated on the gathered sequence")]
        if t > 1:
            out.append(Strategy("sequence", "S", {m.rel: SequenceParallel(use_local_output=True, reduce_grads=True)},
                                _grad_all_reduces(param_bytes), compute_shard=t, activation_shard=t,
                                reason="per-token MLP on the sequence shard, weights replicated",
                                split_tokens=True))
    # a packed [gate|up] needs whole rows of each projection per rank; a plain one may be uneven
    if t > 1 and m.linear and m.hidden and (m.packed == 1 or m.hidden % t == 0):
        k = uneven_shard(m.hidden, t)
        styles = {m.rel: PrepareModuleInput(input_layouts=inp, desired_input_layouts=(R,))}
        styles.update({u: ColwiseParallel(packed=m.packed) for u in m.up})
        styles[m.down] = RowwiseParallel(output_layouts=_PLACEMENT[layout])
        comm = _ag_rs_pair(h) if layout == "S" else _ar_pair(h)
        # packed [gate|up] rows are a strided tensor-parallel shard: FSDP2 shards such a weight on
        # its other dimension (fsdp_shard_placement), its bias not at all (PACKED_BIAS)
        packed = {PACKED_BIAS: "packed gate/up projection's bias"} if m.packed > 1 and m.up_bias else {}
        reason = "up/gate column-wise, down row-wise (Megatron)" + \
            (" with the fused [gate|up] rows sharded per projection" if m.packed > 1 else "")
        out.append(Strategy("hidden_sharded", layout, styles, comm, compute_shard=k, param_shard=k,
                            activation_shard=k, extra=dict(packed, **_uneven("MLP hidden", m.hidden, t)),
                            reason=reason))
        # the same for a block that modifies the MLP's output in place (Falcon: mlp_output +=
        # attention_output): the down projection returns a copy it may modify
        owned = dict(styles, **{m.down: RowwiseParallel(output_layouts=_PLACEMENT[layout], owned_output=True)})
        out.append(Strategy("hidden_sharded_owned_output", layout, owned, comm, compute_shard=k, param_shard=k,
                            activation_shard=k, reason=f"{reason}; its output copied for in-place use",
                            extra=dict(packed, fallback_for="hidden_sharded", **_uneven("MLP hidden", m.hidden, t))))
    return out


def norm_strategies(norms: list[str], t: int, layout: str, param_bytes: list[int],
                    token_dims: dict[str, int] | None = None) -> list[Strategy]:
    """Stream norms: replicated on R; on S sequence parallel with a DTensor output (what a
    pre-norm block's sharded attention/MLP input takes, torchtitan's form) or a local one (a
    post-norm block adds the norm's output to the local residual: OLMo-2). ``token_dims``: norms
    whose input has its tokens on another dimension than 1 (OPT's final norm: flattened, 0)."""
    if layout == "R" or t == 1:
        return [Strategy("replicate", layout, {}, [], reason="replicated")]
    dims = token_dims or {}
    return [Strategy(name, "S", {n: SequenceParallel(sequence_dim=dims.get(n, 1), use_local_output=local,
                                                     reduce_grads=True) for n in norms},
                     _grad_all_reduces(param_bytes), compute_shard=t, activation_shard=t, reason=why, extra=extra)
            for name, local, why, extra in (("sequence", False, "sequence parallel", {}),
                                            ("sequence_local", True, "sequence parallel, local output",
                                             {"fallback_for": "sequence"}))]


def embedding_strategies(e: EmbeddingInfo, t: int, seq_len: int, hidden_bytes: int) -> list[Strategy]:
    """Strategies keyed by their output layout (``stream``)."""
    out = [Strategy("replicate", "R", {}, [], reason="replicated table")]
    if e.shared_with:
        out[0].extra["tp_excluded"] = f"its weight is also used by {', '.join(e.shared_with)}"
        return out
    if t > 1 and e.linear:
        k, uneven = uneven_shard(e.vocab, t), _uneven("vocabulary", e.vocab, t)
        # tables sharing the weight (a decoder's embed_tokens): the same vocabulary split, output whole
        shared = {f: RowwiseParallel(input_layouts=R, output_layouts=R) for f in e.shared_tables}
        also = [Collective("all_reduce", "forward", b) for b in e.shared_tables.values() if b]
        why = f"; shared with {', '.join(e.shared_tables)}, each output all-reduced" if shared else ""
        out.append(Strategy("vocab_sharded", "R", {e.fqn: RowwiseParallel(input_layouts=R, output_layouts=R), **shared},
                            [Collective("all_reduce", "forward", e.output_bytes or hidden_bytes)] + also, param_shard=k,
                            extra=dict(uneven), reason="vocabulary-sharded table, output all-reduced" + why))
        if e.shard_safe and seq_len % t == 0:
            out.append(Strategy("vocab_sharded", "S", {e.fqn: RowwiseParallel(input_layouts=R, output_layouts=S),
                                                       **shared},
                                [Collective("reduce_scatter", "forward", hidden_bytes),
                                 Collective("all_gather", "backward", hidden_bytes)] + also, param_shard=k,
                                extra=dict(uneven),
                                reason="vocabulary-sharded table, output reduce-scattered into the sequence shard"
                                       + why))
    return out


def head_strategies(hd: HeadInfo, t: int, layout: str, hidden_bytes: int) -> list[Strategy]:
    """Strategies for the LM head fed by a stream of ``layout``."""
    inp = _PLACEMENT[layout]
    # a head after a transform (BERT) takes a sequence-sharded stream gathered at the transform's
    # entry: the transform runs replicated on the whole sequence, the head is fed a replicated input
    gather = {hd.entry: PrepareModuleInput(input_layouts=(S,), desired_input_layouts=(R,), use_local_output=True)} \
        if layout == "S" and hd.entry else {}
    if gather:
        inp = R
    if layout == "R":
        out = [Strategy("replicate", "R", {}, [], reason="replicated")]
    else:
        out = [Strategy("replicate", "S", gather or {hd.fqn: PrepareModuleInput(
            input_layouts=(S,), desired_input_layouts=(R,), use_local_output=True)},
            [Collective("all_gather", "forward", hidden_bytes)], reason="replicated on the gathered sequence")]
    if hd.shared_with:
        out[0].extra["tp_excluded"] = f"its weight is also used by {', '.join(hd.shared_with)}"
        return out
    if t > 1 and hd.linear:
        if gather:   # gathered before the transform; the head's input gradient all-reduced
            enter = [Collective("all_gather", "forward", hidden_bytes), Collective("all_reduce", "backward",
                                                                                hd.input_bytes or hidden_bytes)]
        elif layout == "S":
            enter = [Collective("all_gather", "forward", hidden_bytes),
                     Collective("reduce_scatter", "backward", hidden_bytes)]
        else:
            enter = [Collective("all_reduce", "backward", hd.input_bytes or hidden_bytes)]
        k, uneven = uneven_shard(hd.vocab, t), _uneven("vocabulary", hd.vocab, t)
        # DTensor gathers uneven shards padded to ceil(vocab / t) each
        gathered = hd.logits_bytes if hd.vocab % t == 0 else \
            hd.logits_bytes // hd.vocab * math.ceil(hd.vocab / t) * t
        out.append(Strategy("vocab_sharded_gather", layout,
                            {**gather, hd.fqn: ColwiseParallel(input_layouts=inp, output_layouts=R)},
                            enter + [Collective("all_gather", "forward", gathered)],
                            compute_shard=k, param_shard=k, activation_shard=k, extra=dict(uneven),
                            reason="vocabulary-sharded head, logits gathered"))
        out.append(Strategy("loss_parallel", layout,
                            {**gather, hd.fqn: ColwiseParallel(input_layouts=inp, output_layouts=Shard(-1),
                                                               use_local_output=False)},
                            enter + _loss_parallel_reductions(hd),
                            compute_shard=k, param_shard=k, activation_shard=k,
                            reason="vocabulary-sharded head and cross entropy (loss parallel)",
                            extra=dict(uneven, loss_parallel=True)))
    return out


def _loss_parallel_reductions(hd: HeadInfo) -> list[Collective]:
    dtype_bytes = hd.logits_bytes // max(hd.tokens * hd.vocab, 1)
    fp32 = Collective("all_reduce", "forward", hd.tokens * 4, LOSS_FP32_REDUCTIONS)
    if dtype_bytes == 4:
        return [Collective("all_reduce", "forward", hd.tokens * 4, LOSS_FP32_REDUCTIONS + 1)]
    return [fp32, Collective("all_reduce", "forward", hd.tokens * dtype_bytes)]
