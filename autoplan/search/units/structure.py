"""The model as the planner sees it: repeated blocks with attention/MLP/norm units, the
embedding, the final norm and the LM head -- read from the ModelGraph's roles and module table.

Only what the cost of a tensor-parallel decision depends on is kept: FLOPs, bytes, saved
activation bytes, parameter counts, the hidden-stream tensor size and the head/vocabulary
sizes, plus the FQNs the emitted plan will name.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field

from autoplan.capture.ir import ModelGraph, dtype_size
from autoplan.capture.role_paths import lca
from autoplan.capture.views import module_summary, saved_items
from autoplan.search.units.head_fields import folded_attr, head_attributes, kv_fields
from autoplan.search.units.mixers import MAMBA_NOT_A_UNIT, MambaUnit, MoeUnit, mamba_unit, moe_unit
from autoplan.search.units.outside import norms_after_blocks, outside_units
from autoplan.search.units.work import CROSS_ENTROPY_PASSES, Work, loss_work, work_of
from cost_models.fusion import chain_passes, fuse
from hyper_parallel.core.tensor_parallel.linear_styles import CONV1D

_LINEAR = "torch.nn.modules.linear.Linear"
_SHARDABLE_LINEARS = (_LINEAR, CONV1D)     # what Colwise/RowwiseParallel shard as a linear layer
_EMBEDDING = "torch.nn.modules.sparse.Embedding"


@dataclass
class AttentionUnit:
    rel: str                    # module path relative to the block, e.g. "attention"
    q: str
    k: str
    v: str
    o: str
    n_heads: int
    n_kv_heads: int
    linear: bool                # all projections are layers our styles can shard (nn.Linear, Conv1D)
    work: Work = field(default_factory=Work)
    # a fused q/k/v projection (q, k, v are then ""): its module and how its output is cut
    # (roles.fused_qkv_layout): "interleaved" in ``qkv_groups`` groups, "concat" ([q|k|v]) or "unknown"
    qkv: str = ""
    qkv_layout: str = ""
    qkv_groups: int = 0
    fixed_head_count: bool = False   # reshapes by the global head count (roles.fixed_head_count)
    qkv_bias: bool = False           # the fused q/k/v projection has a bias (1-D, strided when packed)
    # attributes its code may cut by, with their global values (head_fields.head_attributes)
    head_attrs: dict[str, int] = field(default_factory=dict)
    # an embedding inside the module with one column per head (T5's relative position bias):
    # sharded by heads along with the projections, so each rank adds its own heads' bias
    bias_table: str = ""
    # parameters the module holds itself with one row per head (GPT-OSS's learnable sinks, one extra
    # logit per head): sharded by heads with the projections (PrepareHeadsInput ``head_params``)
    head_params: list[str] = field(default_factory=list)
    # a cross-attention's k/v read another tensor than the module's first input (the encoder's
    # states): its bytes. Each column projection annotates it on its own, so each reduces its
    # input gradient in backward (0: k/v read the module's input, as self-attention does)
    kv_input_bytes: int = 0
    # the head-count attribute by which per-head tensors it receives with heads folded into the
    # batch dimension are cut (Bloom's ALiBi bias, (batch * heads, 1, seq)); "" when none
    folded_heads: str = ""
    # where the stream enters the heads when that is a module inside ``rel`` holding q, k and v but
    # not o (BERT's ``attention.self``; ``attention`` also adds its input to o's output and
    # normalises, a post-norm residual inside the unit): layouts change there, so that residual
    # and norm see the stream as it is ("": at ``rel``)
    entry: str = ""
    # a latent attention (DeepSeek's MLA, roles/latent.py): replicated projections inside it whose
    # output columns [start, stop) reach the core broadcast to every head -- (module, start, stop,
    # bytes of those columns per call) -- and each column projection's input bytes (the latents,
    # whose gradient each column projection all-reduces when the inputs stay plain)
    broadcast: list[tuple[str, int, int, int]] = field(default_factory=list)
    # the same columns as the module's code names them, per broadcast module: [start, stop], each an
    # attribute path of the module holding that index, or an int; stop None for the last column
    broadcast_columns: dict[str, list] = field(default_factory=dict)
    proj_input_bytes: dict[str, int] = field(default_factory=dict)
    # (FLOPs, parameter, saved-activation) shares of the module's work that stays whole on every
    # rank when a latent attention's heads are sharded: the latent path (down-projections, their
    # norms) and what the column projections save of it -- their inputs, the latents themselves
    replicated_share: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # kv-replicated attention (query heads sharded, K/V whole): the width of one head, the
    # attributes counting query heads per KV head (repeat_kv's num_key_value_groups), with their
    # global values, and the element counts of the parameters kept whole (a fused q/k/v's or k's
    # and v's; each one's gradient is then all-reduced over tp)
    head_dim: int = 0
    group_attrs: dict[str, int] = field(default_factory=dict)
    kv_params: list[int] = field(default_factory=list)
    # every projection parameter's element count ("c_attn.weight": ...): what an uneven-heads plan
    # (heads the tp degree does not divide, projections kept whole) all-reduces the gradients of
    proj_params: dict[str, int] = field(default_factory=dict)
    # a mixture of attention heads (capture.moa_roles: JetMoE's per-expert query/output projections
    # around the core, a shared K/V projection): its recognised fields; planned by moa_strategies
    moa: dict | None = None

    @property
    def projections(self) -> list[str]:
        """The column-parallel candidates (q, k, v or the fused one)."""
        return [self.qkv] if self.qkv else [self.q, self.k, self.v]


@dataclass
class MlpUnit:
    rel: str
    up: list[str]               # column-parallel candidates (gate and up)
    down: str
    hidden: int
    linear: bool
    work: Work = field(default_factory=Work)
    packed: int = 1             # projections fused in each ``up`` Linear ([gate|up]: 2)
    up_bias: bool = False       # an ``up`` projection has a bias
    token_dim: int = 1          # the sequence's dimension in its input (0: tokens flattened: token_dim)


@dataclass
class BlockGroupInfo:
    id: str
    prefix: str
    indices: list[str]
    count: int
    representative: str
    attention: AttentionUnit | None
    mlp: MlpUnit | None
    norms: list[str]
    norm_work: Work
    norm_param_bytes: int       # per block, all norms
    other_work: Work            # everything in the block not in attention/mlp/norms (adds, ...)
    hidden_bytes: int           # one hidden-stream tensor (b, s, h) in bytes
    seq_len: int
    dim: int
    cross_attention: AttentionUnit | None = None   # a decoder's second attention (keys from the encoder)
    moe: MoeUnit | None = None  # a mixture-of-experts layer with stacked expert weights
    mamba: MambaUnit | None = None   # a state-space mixer (split on its channels by MambaMixerParallel)
    norm_token_dims: dict[str, int] = field(default_factory=dict)   # norms whose tokens are not on dim 1


@dataclass
class EmbeddingInfo:
    fqn: str
    vocab: int
    dim: int
    linear: bool                # an nn.Embedding
    work: Work
    shard_safe: bool            # may its output be sequence-sharded (no positions/masks derived outside blocks)
    shared_with: list[str] = field(default_factory=list)   # other modules using its weight (not the head)
    # other embedding tables holding the same weight (T5's / BART's encoder and decoder embed_tokens and
    # ``shared``): sharded with it, by the same style, so the one parameter keeps one layout; bytes each outputs
    shared_tables: dict[str, int] = field(default_factory=dict)
    output_bytes: int = 0       # what its calls output (0: unknown, the stream's bytes); narrower than the
                                # stream when a projection follows it (ELECTRA's embedding_size)


@dataclass
class HeadInfo:
    fqn: str
    vocab: int
    linear: bool
    tied: bool
    work: Work
    tokens: int                 # b * s
    logits_bytes: int
    shared_with: list[str] = field(default_factory=list)   # other modules using its weight (not the embedding)
    # a transform between the stream and the head (BERT's dense + GELU + LayerNorm): replicated, run
    # on the whole sequence; ``entry`` is the module where a sequence-sharded stream is gathered
    transform: list[str] = field(default_factory=list)
    entry: str | None = None
    input_bytes: int = 0        # the head's input after a transform (0: none, the stream's bytes)


@dataclass
class ModelStructure:
    blocks: list[BlockGroupInfo]
    embedding: EmbeddingInfo | None
    head: HeadInfo | None
    final_norms: list[str]
    final_norm_work: Work
    final_norm_param_bytes: int
    rest: Work                  # modules outside every unit (replicated, never sharded)
    dtype_bytes: int
    num_parameters: int
    # attention/MLP modules the planner found but cannot plan as units: (FQN, why); they stay
    # replicated (and keep the stream replicated where they would see a sequence shard)
    not_units: list[tuple[str, str]] = field(default_factory=list)
    # attention units of different block groups that pass per-head state from one to the other
    # (T5's position bias, computed by the first block's attention and added by every later
    # one): (slot, slot, what flows). Their heads must be sharded in both or in neither.
    head_links: list[tuple[str, str, str]] = field(default_factory=list)
    # large linear layers outside every unit (FQN of their nearest common parent, parameters): a
    # model part no unit plans -- a second stack that forms no block group, a lone layer. They
    # stay replicated; a plan says so, and ``allow_replicated_units=False`` refuses it.
    outside_units: list[tuple[str, int]] = field(default_factory=list)

    @property
    def hidden_bytes(self) -> int:
        """One hidden-stream tensor (b, s, h) in bytes: the stream the head reads and a pipeline cuts
        -- the block group carrying the head's tokens at the embedding's width (a VL model's
        decoder, not its vision tower), else the first group's --, else (a model whose one layer
        forms no block group) the embedding's output as the head reads it."""
        stream = self.head.tokens * self.embedding.dim * self.dtype_bytes \
            if self.head is not None and self.embedding is not None else 0
        if self.blocks:
            return next((g.hidden_bytes for g in self.blocks if g.hidden_bytes == stream), self.blocks[0].hidden_bytes)
        return stream


def _type(graph: ModelGraph, fqn: str) -> str:
    """The shardable torch.nn layer a module is (by isinstance at capture), else its own type."""
    m = graph.modules.get(fqn)
    return (m.nn_base or m.type) if m else ""


def _has_bias(graph: ModelGraph, fqn: str) -> bool:
    m = graph.modules.get(fqn)
    return bool(m and "bias" in m.params)


def _attention_unit(graph: ModelGraph, rep: str, a: dict, work) -> AttentionUnit | str:
    """The planner unit of one attention found in block ``rep`` (roles), or why it is none."""
    p = a["projections"]
    where = f"{rep}.{a['module']}" if a["module"] else rep
    attrs = head_attributes(graph, where, a) if a["module"] else {}
    folded = folded_attr(graph, rep, a, where, attrs)
    own = work(f"{rep}.{a['module']}")   # nothing of its own when its projections sit in the block
    kv = kv_fields(graph, rep, where, a)
    if "qkv" in p and "o" in p:
        lin = all(_type(graph, f"{rep}.{p[k]}") in _SHARDABLE_LINEARS for k in ("qkv", "o"))
        return AttentionUnit(a["module"], "", "", "", p["o"], int(a["n_heads"]), int(a["n_kv_heads"]), lin,
                             own, qkv=p["qkv"], qkv_layout=a.get("qkv_layout", "unknown"),
                             qkv_groups=int(a.get("qkv_groups", 0)), fixed_head_count=bool(a.get("fixed_head_count")),
                             head_attrs=attrs, qkv_bias=_has_bias(graph, f"{rep}.{p['qkv']}"), folded_heads=folded,
                             **kv)
    if not all(k in p for k in "qkvo"):
        fused = ", ".join(f"{k}={v}" for k, v in sorted(p.items()))
        return f"its projections ({fused}) are incomplete (no output projection found)"
    broadcast = [(b["module"], int(b["columns"][0]), int(b["columns"][1])) for b in a.get("broadcast", [])]
    lin = all(_type(graph, f"{rep}.{m}") in _SHARDABLE_LINEARS for m in [p[k] for k in "qkvo"] +
              [m for m, _, _ in broadcast])
    unit = AttentionUnit(a["module"], p["q"], p["k"], p["v"], p["o"], int(a["n_heads"]), int(a["n_kv_heads"]), lin,
                         own, fixed_head_count=bool(a.get("fixed_head_count")), head_attrs=attrs,
                         folded_heads=folded, **kv)
    unit.moa = dict(a["moa"]) if a.get("moa") else None
    inner = lca(p[k] for k in "qkv")
    if a["module"] and inner.startswith(a["module"] + ".") and inner not in (p["q"], p["k"], p["v"]) and \
            not (p["o"] + ".").startswith(inner + ".") and not broadcast and not unit.moa:
        unit.entry = inner
    if broadcast:
        unit.broadcast = [(m, start, stop, _column_bytes(graph, f"{rep}.{m}", stop - start))
                          for m, start, stop in broadcast]
        unit.broadcast_columns = {m: _column_spec(graph, where, f"{rep}.{m}", start, stop)
                                  for m, start, stop in broadcast}
        unit.proj_input_bytes = {p[k]: _input_bytes(graph, f"{rep}.{p[k]}") for k in "qkv"}
        heads = sum((work(f"{rep}.{m}") for m in {p[k] for k in "qkvo"}), Work())
        flops, saved = _latent_whole_shares(graph, where, [f"{rep}.{p[k]}" for k in "qkvo"])
        unit.replicated_share = (flops, max(own.params - heads.params, 0) / max(own.params, 1), saved)
    return unit


def _latent_whole_shares(graph: ModelGraph, where: str, head_projections: list[str]) -> tuple[float, float]:
    """(FLOPs share, saved-bytes share) of latent attention ``where`` that stays whole on every
    rank when its heads are sharded. Split by heads: the per-head projections and the module's
    own ops (the core runs on the local heads) -- their work, and the tensors they make. Whole:
    the latent path (down-projections, their norms), its work and its tensors, which include what
    the column projections save (their inputs, the latents)."""
    def split(module: str) -> bool:
        return module == where or any(module == h or module.startswith(h + ".") for h in head_projections)

    nodes = graph.nodes_in(where)
    flops = [0.0, 0.0]   # whole, split
    for n in nodes:
        flops[split(n.module)] += n.flops_fwd + n.flops_bwd
    saved = [0, 0]
    for module, nbytes in saved_items(graph, nodes, {n.name: n for n in graph.nodes}):
        saved[split(module)] += nbytes
    return flops[0] / max(sum(flops), 1.0), saved[0] / max(sum(saved), 1)


def _column_spec(graph: ModelGraph, where: str, linear: str, start: int, stop: int) -> list:
    """[start, stop] of a linear's output columns as module ``where``'s code names them: the path of
    an integer attribute it (or its config) holds with that value -- so the plan fits the model
    at any width -- else the int; stop None when it is the linear's last column."""
    attrs = graph.modules[where].size_attrs if where in graph.modules else {}
    weight = graph.modules[linear].params.get("weight", ()) if linear in graph.modules else ()
    width = weight[0] if len(weight) == 2 else None

    def name(value: int):
        own = sorted(k for k, v in attrs.items() if v == value and "." not in k)
        config = sorted(k for k, v in attrs.items() if v == value and "." in k)
        return (own or config or [value])[0]

    return [0 if start == 0 else name(start), None if stop == width else name(stop)]


def _column_bytes(graph: ModelGraph, fqn: str, columns: int) -> int:
    """Bytes of ``columns`` output columns of linear ``fqn`` over every token it sees per call."""
    for n in graph.nodes_in(fqn):
        if n.outputs and n.outputs[0].shape and n.outputs[0].shape[-1]:
            out = n.outputs[0]
            return out.numel // out.shape[-1] * columns * dtype_size(out.dtype)
    return 0


def _bias_table(graph: ModelGraph, rep: str, unit: AttentionUnit) -> str:
    """The path (from the block) of an embedding inside the attention module with one column per
    head -- a per-head position bias table (T5's relative_attention_bias) -- or ""."""
    if not unit.rel:
        return ""
    inside = f"{rep}.{unit.rel}."
    for fqn, info in graph.modules.items():
        if fqn.startswith(inside) and info.role == "position_embedding" and _type(graph, fqn) == _EMBEDDING:
            weight = info.params.get("weight")
            if weight is not None and len(weight) == 2 and weight[1] == unit.n_heads:
                return fqn[len(rep) + 1:]
    return ""


def _head_params(graph: ModelGraph, rep: str, unit: AttentionUnit) -> list[str]:
    """Parameters attention module ``unit`` holds itself (not through a submodule) whose first
    dimension is its head count: per-head values its own code combines with each head's scores
    (GPT-OSS's ``sinks``)."""
    info = graph.modules.get(f"{rep}.{unit.rel}") if unit.rel else None
    if info is None:
        return []
    return sorted(n for n, shape in info.params.items() if shape and shape[0] == unit.n_heads)


def _input_bytes(graph: ModelGraph, fqn: str) -> int:
    """Bytes of the first tensor module ``fqn``'s first op reads (a projection's input)."""
    for n in graph.nodes_in(fqn):
        for t in n.inputs:
            if "float" in t.dtype:
                return dtype_size(t.dtype) * math.prod(t.shape)
    return 0


def head_links(graph: ModelGraph, blocks: list[BlockGroupInfo]) -> list[tuple[str, str, str]]:
    """Pairs of attention slots in different block groups where a tensor made inside one
    attention module (not its output projection's result, which leaves through the block) is
    read inside the other: per-head state such as T5's position bias. Read from the captured
    dataflow, so any model that hands a head-shaped tensor from layer to layer is covered."""
    units = []
    for b in blocks:
        for name, u in (("attention", b.attention), ("cross_attention", b.cross_attention)):
            if u is not None and u.rel:
                units.append((f"{b.id}/{name}", f"{b.representative}.{u.rel}", f"{b.representative}.{u.o}"))

    def unit_of(module: str) -> tuple[str, str, str] | None:
        return next((x for x in units if module == x[1] or module.startswith(x[1] + ".")), None)

    by_name = {n.name: n for n in graph.nodes}
    links: dict[tuple[str, str], str] = {}
    for e in graph.edges:
        src, dst = by_name.get(e.src), by_name.get(e.dst)
        if src is None or dst is None:
            continue
        a, b = unit_of(src.module), unit_of(dst.module)
        if a is None or b is None or a[0] == b[0] or src.module == a[2] or src.module.startswith(a[2] + "."):
            continue
        key = tuple(sorted((a[0], b[0])))
        links.setdefault(key, f"{src.module} -> {dst.module} {tuple(e.shape)}")
    return [(x, y, why) for (x, y), why in sorted(links.items())]


def _head_modules(graph: ModelGraph) -> list[str]:
    return [h["module"] for h in graph.roles.get("lm_head", [])[:1]]


def _output_bytes(graph: ModelGraph, module: str) -> int:
    """Bytes a module's calls output (0 for a module holding a shared table that nothing calls)."""
    return sum(n.outputs[0].nbytes for n in graph.nodes if n.module == module and n.outputs
               and not any(m.module == module for m in graph.nodes if m.name in n.input_nodes))


def _param_sharers(graph: ModelGraph, module: str, exclude: list[str], computing: bool = False) -> list[str]:
    """Modules other than ``module`` and ``exclude`` that hold one of ``module``'s parameters
    (T5's encoder and decoder token embeddings share ``shared.weight``): sharding the parameter
    through one module's style would leave the others computing with it unsharded.
    ``computing``: only holders whose own ops use it -- one that merely holds it (BERT's
    ``cls.predictions.bias``, the decoder's bias) follows the replacement in
    ``parallelize_module``, which re-points every holder of a replaced parameter."""
    info = graph.modules.get(module)
    names = {f"{module}.{p}" if module else p for p in (info.params if info else {})}
    used = {(n.module, p) for n in graph.nodes for p in n.params} if computing else set()
    out: set[str] = set()
    for group in graph.tied_parameters:
        if names & set(group):
            for name in group:
                owner = name.rsplit(".", 1)[0] if "." in name else ""
                if not computing or (owner, name) in used:
                    out.add(owner)
    return sorted(out - {module} - set(exclude))


def model_structure(graph: ModelGraph, loss_bytes_per_logit: float | None = None,
                    compile: str = "none") -> ModelStructure:
    """Extract the planner's units from a captured graph. The head's work includes the loss the
    runners compute on its logits (``units.work.loss_work``; ``loss_bytes_per_logit``: another
    runtime's, None: ours, ``CROSS_ENTROPY_PASSES`` passes over the logits, one fused chain's
    passes when the whole model is compiled). ``compile``: what runs compiled
    (cost_models.fusion.COMPILE_MODES), its elementwise chains priced fused."""
    fusion = fuse(graph.nodes, compile)
    summary = module_summary(graph)
    rows = {r["fqn"]: r for r in summary.to_dict("records")}
    float_dtypes = [o.dtype for n in graph.nodes for o in n.outputs if "float" in o.dtype or "bfloat" in o.dtype]
    dtype_bytes = dtype_size(float_dtypes[0]) if float_dtypes else 4

    def work(fqn):
        w = work_of(graph, fqn, rows, fusion)
        w.param_bytes = w.params * dtype_bytes
        return w

    claimed: set[str] = set()
    blocks = []
    not_units: list[tuple[str, str]] = []
    for b in graph.blocks:
        rep = b.representative
        roles = b.roles or {}
        att = cross = None
        for a in roles.get("attention", []):
            where = f"{rep}.{a['module']}" if a["module"] else rep
            unit = _attention_unit(graph, rep, a, work)
            if isinstance(unit, str):
                not_units.append((where, unit))
                continue
            unit.bias_table = _bias_table(graph, rep, unit)
            unit.head_params = _head_params(graph, rep, unit)
            if att is None:
                att = unit
            elif cross is None and unit.rel:
                cross = unit   # the block's second attention: cross-attention (BART, T5 decoders)
                kv = unit.qkv or unit.k
                cross.kv_input_bytes = _input_bytes(graph, f"{rep}.{kv}")
            else:
                not_units.append((where, "a third attention in the block (or a second one with its projections "
                                         "directly in the block) is not planned"))
        for u in roles.get("attention_untraced", []):
            where = f"{rep}.{u['module']}" if u["module"] else rep
            not_units.append((where, f"an attention whose projections were not recognised ({u['why']})"))
        for u in roles.get("routed_untraced", []):
            not_units.append((f"{rep}.{u['module']}" if u["module"] else rep, u["why"]))
        moe = None
        for e in roles.get("moe", []):
            where = f"{rep}.{e['module']}" if e.get("module") else rep
            unit = moe_unit(graph, rep, e, work) if moe is None else "a second mixture-of-experts layer in the block"
            if isinstance(unit, str):
                not_units.append((where, f"a mixture-of-experts layer: {unit}"))
            else:
                moe = unit
        mamba = None
        for x in roles.get("mamba", []):
            unit = mamba_unit(graph, rep, x, work) if mamba is None and x["module"] else None
            if unit is None:
                not_units.append((f"{rep}.{x['module']}" if x["module"] else rep, MAMBA_NOT_A_UNIT))
            else:
                mamba = unit
        mlp = None
        for m in roles.get("mlp", [])[1:]:
            not_units.append((f"{rep}.{m['module']}" if m["module"] else rep, "a second MLP in the block"))
        for m in roles.get("mlp", [])[:1]:
            packed = 2 if m.get("gate_up") else 1   # [gate|up] in one Linear (Phi-3)
            ups = [m[k] for k in ("gate_up", "gate", "up") if m.get(k)]
            lin = all(_type(graph, f"{rep}.{x}") in _SHARDABLE_LINEARS for x in ups + [m["down"]])
            if m["module"]:
                mw = work(f"{rep}.{m['module']}")
            else:  # the MLP's linears sit directly in the block (OPT fc1/fc2): no container module
                mw = Work()
                for x in ups + [m["down"]]:
                    mw = mw + work(f"{rep}.{x}")
            mlp = MlpUnit(m["module"], ups, m["down"], int(m.get("hidden", 0)), lin, mw, packed=packed,
                          up_bias=any(_has_bias(graph, f"{rep}.{u}") for u in ups),
                          token_dim=token_dim(rows, f"{rep}.{ups[0]}") if ups else 1)
        # residual-stream norms only: a norm inside the attention or MLP (Qwen3's q/k norms)
        # sees that unit's activations, not the stream, and belongs to the unit
        # (an attention's norm outside the module its stream enters, BERT's post-norm in
        # ``attention.output``, normalises the residual stream)
        inner = [u.entry or u.rel for u in (att, cross) if u is not None and u.rel] + \
            ([mlp.rel] if mlp is not None and mlp.rel else []) + \
            [u["module"] for u in roles.get("attention_untraced", []) + roles.get("mamba", []) if u["module"]]
        norms = [n for n in roles.get("norms", []) if not any(n == r or n.startswith(r + ".") for r in inner)]
        norm_work = Work()
        for n in norms:
            norm_work = norm_work + work(f"{rep}.{n}")
        whole = work(rep)
        inner = sum((u.work for u in (att, cross, mlp, moe, mamba) if u is not None), Work())
        for n in norms:   # a stream norm inside an attention module (BERT's) is in that unit's work already
            if not any(n.startswith(u.rel + ".") for u in (att, cross) if u is not None and u.rel):
                inner = inner + work(f"{rep}.{n}")
        other = Work(max(whole.flops - inner.flops, 0), max(whole.bytes - inner.bytes, 0),
                     max(whole.saved - inner.saved, 0), max(whole.kernels - inner.kernels, 0),
                     max(whole.params - inner.params, 0), max(whole.param_bytes - inner.param_bytes, 0),
                     (), max(whole.other_bytes - inner.other_bytes, 0),
                     fused_kernels=max(whole.fused_kernels - inner.fused_kernels, 0))
        # the residual stream: the output shaped like an input (a block may return more, first:
        # T5's first block returns its position bias beside the hidden states)
        out_shapes = [tuple(o) for o in rows[rep]["output_shapes"]] if rep in rows else []
        in_shapes = {tuple(i) for i in rows[rep]["input_shapes"]} if rep in rows else set()
        # (a block captured at module level may record no output: its first input then, the stream)
        first_in = tuple(rows[rep]["input_shapes"][0]) if rep in rows and rows[rep]["input_shapes"] else (1, 1, 1)
        shape = next((o for o in out_shapes if o in in_shapes), out_shapes[0] if out_shapes else first_in)
        hidden = 1
        for s in shape:
            hidden *= s
        blocks.append(BlockGroupInfo(
            b.id, b.prefix, list(b.indices), b.count, rep, att, mlp, norms, norm_work,
            norm_work.param_bytes, other, hidden * dtype_bytes, shape[1] if len(shape) > 2 else 1, shape[-1],
            cross_attention=cross, moe=moe, mamba=mamba,
            norm_token_dims={n: d for n in norms if (d := token_dim(rows, f"{rep}.{n}")) != 1}))
        claimed.add(rep)

    outside_positions = any(n.block is None and "arange" in n.op for n in graph.nodes) or any(
        "rotary" in m.type.lower() for m in graph.modules.values())
    emb = None
    for e in graph.roles.get("embedding", [])[:1]:
        emb = EmbeddingInfo(e["module"], int(e["vocab"]), int(e["dim"]), _type(graph, e["module"]) == _EMBEDDING,
                            work(e["module"]), shard_safe=not outside_positions)
        # the lookups' output (Gemma's module also scales it, a 0-d constant beside it)
        emb.output_bytes = sum(n.outputs[0].nbytes for n in graph.nodes
                               if n.module == e["module"] and n.outputs and n.op.startswith("aten.embedding"))
        sharers = _param_sharers(graph, e["module"], exclude=_head_modules(graph))
        if emb.linear:   # tables of the same class share its vocabulary-sharded semantics
            emb.shared_tables = {f: _output_bytes(graph, f) for f in sharers if _type(graph, f) == _EMBEDDING}
        emb.shared_with = [f for f in sharers if f not in emb.shared_tables]
    head = None
    for h in graph.roles.get("lm_head", [])[:1]:
        row = rows.get(h["module"], {})
        outs = row.get("output_shapes") or [(1, 1, int(h["vocab"]))]
        tokens = 1
        for s in tuple(outs[0])[:-1]:
            tokens *= s
        head = HeadInfo(h["module"], int(h["vocab"]), _type(graph, h["module"]) == _LINEAR, bool(h.get("tied")),
                        work(h["module"]), tokens, tokens * int(h["vocab"]) * dtype_bytes)
        emb_mods = [e["module"] for e in graph.roles.get("embedding", [])[:1]]
        if head.tied and emb is not None:   # sharded with the embedding or not at all: its tables go with it
            emb_mods += list(emb.shared_tables)
        head.shared_with = _param_sharers(graph, h["module"], exclude=emb_mods, computing=True)
        head.transform, head.entry = list(h.get("transform", [])), h.get("entry")
        if head.transform and row.get("input_shapes"):
            head.input_bytes = math.prod(row["input_shapes"][0]) * dtype_bytes
    final_norms, before = norms_after_blocks(graph, list(graph.roles.get("norms", [])))
    if before and emb is not None:
        # a norm between the embedding and the first block (Bloom's word_embeddings_layernorm)
        # reads the whole sequence as the embedding gives it: the stream is sharded at the first
        # block, and the norm stays replicated with the rest of the model outside the units
        emb.shard_safe = False
    fn_work = Work()
    for n in final_norms:
        fn_work = fn_work + work(n)
    total = work("")
    used = fn_work + (emb.work if emb else Work()) + (head.work if head else Work())
    for b in blocks:
        w = work(b.representative)
        used = used + Work(w.flops * b.count, w.bytes * b.count, w.saved * b.count, w.kernels * b.count,
                           w.params * b.count, w.param_bytes * b.count)
    rest = Work(max(total.flops - used.flops, 0), max(total.bytes - used.bytes, 0), max(total.saved - used.saved, 0),
                max(total.kernels - used.kernels, 0), max(total.params - used.params, 0),
                max(total.param_bytes - used.param_bytes, 0))
    if head is not None and head.tied and emb is not None:
        rest.params = max(rest.params, 0)
    if head is not None:   # after ``rest``: the loss is no captured op, so none of ``total``
        passes = chain_passes(1, 0) if fusion.scope == "model" else CROSS_ENTROPY_PASSES
        per_logit = passes * dtype_bytes if loss_bytes_per_logit is None else loss_bytes_per_logit
        head.work = head.work + loss_work(head.tokens, head.vocab, per_logit)
    covered = [emb.fqn] if emb else []
    covered += ([head.fqn] + head.transform if head else []) + final_norms
    return ModelStructure(blocks, emb, head, final_norms, fn_work, fn_work.param_bytes, rest, dtype_bytes,
                          graph.num_parameters, not_units, head_links(graph, blocks),
                          outside_units(graph, covered))


def token_dim(rows: dict, fqn: str) -> int:
    """The sequence's dimension in ``fqn``'s first input, from the captured shapes (1 if unknown).

    Dimension 1 of (batch, sequence, hidden), or 0 where the model flattened the tokens first
    (OPT's decoder layer reshapes the stream to (tokens, hidden) before its final norm and
    fc1/fc2). A sequence-sharded stream is sharded on that dimension there: a flattened local
    shard (batch x sequence/tp, hidden) is the rank's tokens on dimension 0, and a gather /
    reduce-scatter on dimension 0 concatenates and splits the ranks' tokens in the same order,
    which is all a per-token unit needs (a norm, an MLP)."""
    shapes = (rows.get(fqn) or {}).get("input_shapes") or []
    return 0 if shapes and len(tuple(shapes[0])) == 2 else 1
