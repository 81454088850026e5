"""Roles (attention, MLP, MoE, embedding, LM head, norm) read from the dataflow, not from names.

Attention is the op that does softmax(QK^T)V (SDPA, or softmax between two activation matmuls);
its q/k/v projections are the nearest matmuls with a weight upstream of its operands, its output
projection the nearest one downstream. An MLP is a weighted matmul fed (through elementwise ops
only) by other weighted matmuls; gated when that path multiplies two of them. A router is the
weighted matmul feeding a top-k; experts are the weights the grouped GEMMs after it use. A
state-space (Mamba) mixer is the module around a depthwise 1-D convolution fed by a weighted matmul
(its in_proj): its linears are the mixer's, never an MLP, even where a gate path multiplies them.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterator

from autoplan.capture.aliases import aliases, is_inplace, op_base
from autoplan.capture.ir import ModelGraph, Node
from autoplan.capture.latent import latent_projections
from autoplan.capture.mixer_roles import flat_experts, mamba_mixers, paired_experts, routed_modules
from autoplan.capture.moa_roles import mixture_of_heads
from autoplan.capture.role_paths import lca as _lca, out_features as _out_features, param_shape as _param_shape
from autoplan.capture.role_paths import rel as _rel

_MATMUL = ("aten.linear", "aten.addmm", "aten.mm", "aten.matmul", "aten.bmm")
_ACT = ("silu", "gelu", "relu", "tanh", "sigmoid", "elu", "mish", "softplus")
_NORM = ("layer_norm", "rms_norm", "group_norm", "batch_norm", "rsqrt")
# ops a value passes through without ceasing to be "the same tensor" for role tracing
_PASS = (
    "view", "reshape", "transpose", "permute", "contiguous", "clone", "to", "_to_copy", "expand", "broadcast_to",
    "unsqueeze", "squeeze", "getitem", "split", "chunk", "slice", "select", "cat", "stack", "mul",
    "add", "sub", "neg", "div", "dropout", "repeat", "index", "type_as", "float", "flatten",
    "unflatten", "alias", "t", "native_dropout", "masked_fill", "where", "_unsafe_view", "unbind",
    # a clamp of a fused q/k/v (DBRX's clip_qkv) and per-head norms of q and k (Persimmon's
    # q_layernorm / k_layernorm) sit between a projection and the attention core
    "clamp", "clip", "native_layer_norm", "layer_norm",
    # squared-ReLU MLPs (Nemotron, Persimmon, Primer): relu(x) ** 2 between up and down
    "square", "pow",
) + _ACT


def _passes(n: Node, extra: tuple[str, ...] = ()) -> bool:
    """Whether an upstream walk goes through ``n``: a pass-through op (or one of ``extra``)."""
    base = _base(n.op)
    return base.startswith(_PASS + extra) or base == "getitem"


_base = op_base


_WEIGHT_VIEW = ("t", "numpy_T", "transpose", "permute", "view", "reshape", "alias", "to", "_to_copy", "expand", "contiguous")


def weight_of(node: Node, graph: ModelGraph, param_views: dict[str, str] | None = None) -> str | None:
    """The 2-D weight parameter of a matmul-like node (used directly or through a transpose/
    view/cast of it, as in ``x @ self.weight.T``), else None."""
    if not node.op.startswith(_MATMUL):
        return None
    for src, meta in zip(node.input_nodes, node.inputs):
        if src.startswith("param:") and len(meta.shape) == 2:
            return src[6:]
        if param_views and src in param_views and len(meta.shape) == 2:
            return param_views[src]
    return None


def _param_views(graph: ModelGraph) -> dict[str, str]:
    """Node name -> parameter FQN for nodes that only re-view or cast a parameter."""
    out: dict[str, str] = {}
    for n in graph.nodes:
        if not _base(n.op).startswith(_WEIGHT_VIEW) or not n.input_nodes:
            continue
        src = n.input_nodes[0]
        if src.startswith("param:"):
            out[n.name] = src[6:]
        elif src in out:
            out[n.name] = out[src]
    return out


class _Flow:
    def __init__(self, graph: ModelGraph):
        self.graph = graph
        self.param_views = _param_views(graph)
        self.by_name = {n.name: n for n in graph.nodes}
        self.users: dict[str, list[Node]] = defaultdict(list)
        for n in graph.nodes:
            for src in n.input_nodes:
                self.users[src].append(n)
        # in-place writes into views (autoplan.capture.aliases): a write feeds every later read
        # of the buffer it writes into (downstream walks go from the write to those readers), and
        # a read of the buffer depends on the writes before it (upstream walks, walk_up)
        self.aliases = aliases(graph.nodes)
        self.inplace = {n.name for n in graph.nodes if is_inplace(n)}
        pos = self.aliases.position
        for w in sorted(self.inplace, key=pos.__getitem__):
            readers = {u.name: u for m in self.aliases.members(self.aliases.buffer(w))
                       for u in list(self.users.get(m, [])) if pos[u.name] > pos[w]}
            self.users[w].extend(u for name, u in readers.items() if name != w)

    def weight(self, node: Node) -> str | None:
        return weight_of(node, self.graph, self.param_views)

    def walk_up(self, name: str, limit: int = 40, extra: tuple[str, ...] = (), outside: bool = False) -> Iterator[Node]:
        """Every node upstream of tensor ``name`` reached through pass-through ops (views,
        elementwise, ``getitem``; ``extra`` adds kinds), each once; a weighted matmul is yielded
        but not walked past. ``outside``: nodes inside a block are neither yielded nor walked
        past (a path outside every block does not run through the residual stream of one)."""
        stack, seen = [(name, float("inf"))], set()
        while stack and len(seen) < limit:
            cur, reader = stack.pop()
            if cur in seen or cur not in self.by_name:
                continue
            seen.add(cur)
            n = self.by_name[cur]
            if outside and n.block is not None:
                continue
            yield n
            if self.weight(n):
                continue
            here = self.aliases.position[cur]
            if _passes(n, extra) or cur in self.inplace:
                stack.extend((s, here) for s in n.input_nodes if s in self.by_name)
            # what was written in place into the buffer read here, before this read
            stack.extend((w, here) for w in self.aliases.writes_before(cur, reader))

    def up_matmuls(self, name: str, limit: int = 40, extra: tuple[str, ...] = (),
                   outside: bool = False) -> tuple[list[Node], set[str]]:
        """Nearest weighted matmuls upstream of tensor ``name`` and the op kinds passed on the way
        (``outside``: see :meth:`walk_up`)."""
        found, ops = [], set()
        for n in self.walk_up(name, limit, extra, outside):
            if self.weight(n):
                found.append(n)
            elif _passes(n, extra):
                ops.add(_base(n.op))
        return found, ops

    def down_matmul(self, name: str, limit: int = 20) -> Node | None:
        stack, seen = [name], set()
        while stack and len(seen) < limit:
            cur = stack.pop(0)
            if cur in seen:
                continue
            seen.add(cur)
            for u in self.users.get(cur, []):
                if self.weight(u):
                    return u
                if _base(u.op).startswith(_PASS):
                    stack.append(u.name)
        return None


_BMM = ("matmul", "bmm", "baddbmm", "einsum")


def _attention_cores(flow: _Flow) -> list[tuple[Node, str, str, str, Node, Any]]:
    """(core node, q, k, v tensor names, output node, q metadata) for every attention."""
    cores = []
    for n in flow.graph.nodes:
        if "scaled_dot_product" in n.op or "flash_attention" in n.op:
            cores.append((n, n.input_nodes[0], n.input_nodes[1], n.input_nodes[2], n, n.inputs[0]))
        elif _base(n.op) in ("softmax", "_softmax"):
            scores = _find_up(flow, n.input_nodes[0], _BMM)
            out = _find_down(flow, n.name, _BMM)
            if scores is None or out is None:
                continue
            acts = [(s, m) for s, m in zip(scores.input_nodes, scores.inputs) if s in flow.by_name]
            if len(acts) < 2 or any(s.startswith("param:") for s in scores.input_nodes + out.input_nodes):
                continue
            (q, qmeta), (k, _) = acts[-2], acts[-1]  # baddbmm(bias, q, k): the last two
            v = next((s for s in out.input_nodes if s in flow.by_name and not _derived(flow, s, n.name)), None)
            if v is None:
                continue
            cores.append((n, q, k, v, out, qmeta))
    return cores


def _derived(flow: _Flow, name: str, ancestor: str, limit: int = 6) -> bool:
    cur = [name]
    for _ in range(limit):
        if ancestor in cur:
            return True
        cur = [s for c in cur if c in flow.by_name for s in flow.by_name[c].input_nodes]
    return ancestor in cur


def _find_up(flow: _Flow, name: str, kinds: tuple[str, ...], limit: int = 8) -> Node | None:
    """Nearest node of one of ``kinds`` upstream of ``name`` (breadth first, ``limit`` steps)."""
    frontier = [name]
    for _ in range(limit):
        nxt = []
        for cur in frontier:
            n = flow.by_name.get(cur)
            if n is None:
                continue
            if _base(n.op) in kinds:
                return n
            nxt.extend(s for s in n.input_nodes if s in flow.by_name)
        frontier = nxt
    return None


def _find_down(flow: _Flow, name: str, kinds: tuple[str, ...], limit: int = 6) -> Node | None:
    frontier = [name]
    for _ in range(limit):
        nxt = []
        for f in frontier:
            for u in flow.users.get(f, []):
                if _base(u.op) in kinds:
                    return u
                nxt.append(u.name)
        frontier = nxt
    return None


def fixed_head_count(flow: _Flow, name: str, n_heads: int, limit: int = 40) -> bool:
    """Whether a reshape between tensor ``name`` (q, k or v at the attention) and its projection
    names the global head count while inferring another dimension (OPT:
    ``view(bsz, -1, num_heads, head_dim)``): on a column shard that reshape does not fail, it
    folds the missing heads into the sequence, a silently wrong attention the shape checks of a
    probe run cannot see."""
    for n in flow.walk_up(name, limit):
        if flow.weight(n) or _base(n.op) not in ("view", "reshape", "_unsafe_view"):
            continue
        shape = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], list) else []
        # (..., heads, head_dim) with an explicit head count and an inferred leading dimension
        if len(shape) >= 3 and shape[-2] == n_heads and -1 in shape[:-2]:
            return True
    return False


_SPLITS = ("split", "split_with_sizes", "chunk", "slice", "unbind", "narrow")


def fused_qkv_layout(flow: _Flow, proj: Node, limit: int = 6) -> tuple[str, int]:
    """How a fused q/k/v projection's output is cut into q, k and v: ``("interleaved", G)`` when
    the output width is first reshaped into G groups (GPT-NeoX and Bloom: q, k, v of one head
    side by side; Falcon: one KV group's q heads, k and v), so a contiguous row block of the
    weight holds whole groups; ``("concat", 0)`` when it is split along the full width
    ([q|k|v], GPT-2), so each rank needs its slice of every part; ``("unknown", 0)`` otherwise.
    Views keeping the last dimension whole (addmm's 2-D result viewed back to 3-D) are followed."""
    width = _out_features(proj)
    cur = proj
    for _ in range(limit):
        users = flow.users.get(cur.name, [])
        if not users:
            break
        u = users[0]
        base = _base(u.op)
        shape = tuple(u.outputs[0].shape) if u.outputs else ()
        if base in _SPLITS:
            return "concat", 0
        if base in ("clamp", "clip", "to", "_to_copy", "contiguous") and shape and shape[-1] == width:
            cur = u   # DBRX clamps its fused q/k/v (clip_qkv) before cutting it
            continue
        if base in ("view", "reshape", "_unsafe_view", "unflatten", "unsqueeze") and shape:
            if shape[-1] == width:
                cur = u
                continue
            for i in range(len(shape) - 1, 0, -1):   # trailing dims that multiply to the width
                prod = 1
                for d in shape[i:]:
                    prod *= d
                if prod == width:
                    return "interleaved", int(shape[i])
                if prod > width:
                    break
        break
    return "unknown", 0


def recognise_roles(graph: ModelGraph) -> None:
    """Fill ``graph.roles``, each ``BlockGroup.roles`` and ``ModuleInfo.role`` in place."""
    flow = _Flow(graph)
    role: dict[str, str] = {}
    per_block: dict[str | None, dict[str, Any]] = defaultdict(lambda: defaultdict(list))
    rep_of = {b.id: b.representative for b in graph.blocks}
    claimed: set[str] = set()

    core_modules: set[str] = set()   # modules an attention core runs in, below block level
    for core, q, k, v, out, qmeta in _attention_cores(flow):
        if core.module and core.module not in rep_of.values():
            core_modules.add(core.module)
        (qs, _), (ks, _), (vs, _) = flow.up_matmuls(q), flow.up_matmuls(k), flow.up_matmuls(v)
        o = flow.down_matmul(out.name)
        missing = [x for x, found in (("q", qs), ("k", ks), ("v", vs)) if not found]
        picked = latent_projections(flow, core, qs, ks, vs) if not missing else None
        if missing or isinstance(picked, str):
            # q, k or v reaches the core by a path the flow does not follow, or by several
            # projections it cannot tell apart: not a unit, and its linears are no MLP either
            why = f"its {'/'.join(missing)} input could not be traced to a projection" if missing else picked
            per_block[core.block]["attention_untraced"].append(
                {"module": _rel(core.module, rep_of.get(core.block, "")), "why": why})
            continue
        (qn, kn, vn), broadcast = picked
        head_dim = qmeta.shape[-1]
        fused = qn.module == kn.module == vn.module
        kmeta = flow.by_name[k].outputs[0] if k in flow.by_name and flow.by_name[k].outputs else None
        if broadcast and (kmeta is None or len(kmeta.shape) != 4 or len(qmeta.shape) != 4):
            per_block[core.block]["attention_untraced"].append(
                {"module": _rel(core.module, rep_of.get(core.block, "")),
                 "why": "a latent attention whose q/k are not (batch, heads, seq, dim) at its core"})
            continue
        if len(qmeta.shape) == 4:
            n_heads = qmeta.shape[1]
        elif fused:  # (batch*heads, seq, dim) layouts: heads from the projection width
            n_heads = _out_features(qn) // max(head_dim, 1) // 3
        else:
            n_heads = _out_features(qn) // max(head_dim, 1)
        if fused:
            total = _out_features(qn) // max(head_dim, 1)
            n_kv = max((total - n_heads) // 2, 1)
            names = {"qkv": qn.module}
            role[qn.module] = "attention.qkv"
            layout, groups = fused_qkv_layout(flow, qn)
        else:
            # a latent attention's k/v come from one up-projection of [k | v] per head: its k's heads
            n_kv = kmeta.shape[1] if broadcast else _out_features(kn) // max(head_dim, 1)
            names = {"q": qn.module, "k": kn.module, "v": vn.module}
            for key, mod in names.items():
                role[mod] = f"attention.{key}"
        if o is not None:
            names["o"] = o.module
            role[o.module] = "attention.o"
        container = _lca(names.values())
        block = core.block
        base = rep_of.get(block, "")
        role.setdefault(container, "attention")
        claimed.update(names.values())
        claimed.update(m for m, _ in broadcast)
        role.update({m: "attention.broadcast" for m, _ in broadcast})
        per_block[block]["attention"].append(
            {
                "module": _rel(container, base),
                "projections": {k2: _rel(m, base) for k2, m in names.items()},
                "n_heads": n_heads,
                "n_kv_heads": n_kv,
                "head_dim": head_dim,
                "op": core.op,
                **({"qkv_layout": layout, "qkv_groups": groups} if fused else {}),
                **({"broadcast": [{"module": _rel(m, base), "columns": list(cols)} for m, cols in broadcast]}
                   if broadcast else {}),
                "fixed_head_count": any(fixed_head_count(flow, x, h) for x, h in ((q, n_heads), (k, n_kv), (v, n_kv))),
            }
        )

    mamba_mixers(flow, role, per_block, rep_of, claimed)

    for n in graph.nodes:
        if _base(n.op) != "topk":
            continue
        routers, _ = flow.up_matmuls(n.input_nodes[0], extra=("softmax", "_softmax", "sigmoid", "log_softmax"))
        if not routers:
            continue
        r = routers[0]
        if r.module in claimed:  # a later top-k on the same scores (group-limited routing): it selects the experts
            for entry in per_block[n.block]["moe"]:
                if entry["router"] == _rel(r.module, rep_of.get(n.block, "")):
                    entry["top_k"] = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], int) else entry["top_k"]
            continue
        top_k = n.args[1] if len(n.args) > 1 and isinstance(n.args[1], int) else n.kwargs.get("k")
        parent = r.module.rpartition(".")[0]
        after = [m for m in graph.nodes if m.block == n.block and (m.module + ".").startswith(parent + ".")]
        expert_params = sorted({p for m in after for p in m.params if len(_param_shape(graph, p)) == 3})
        experts_mod = _lca(p.rpartition(".")[0] for p in expert_params) if expert_params else ""
        if not expert_params:  # experts as a list of modules: the weighted matmuls after the router
            mods = sorted({m.module for m in after if flow.weight(m) and m.module != r.module})
            experts_mod = _lca(mods)
        base = rep_of.get(n.block, "")
        role[r.module] = "moe.router"
        claimed.add(r.module)
        if experts_mod:
            role[experts_mod] = "moe.experts"
        container = _lca([r.module, experts_mod]) if experts_mod else r.module
        role.setdefault(container, "moe")
        per_block[n.block]["moe"].append(
            {
                "module": _rel(container, base),
                "router": _rel(r.module, base),
                "experts": _rel(experts_mod, base),
                "num_experts": _out_features(r),
                "top_k": top_k,
                "expert_params": [_rel(p, base) for p in expert_params],
            }
        )
        claimed.update(m.module for m in after if flow.weight(m) and m.module.startswith(experts_mod + "."))

    flat_experts(flow, role, per_block, rep_of, claimed)
    mixture_of_heads(flow, role, per_block, rep_of, claimed)
    paired_experts(flow, role, per_block, rep_of, claimed)

    token = _token_table(graph, flow)
    for n in graph.nodes:
        if not flow.weight(n) or n.module in claimed or _is_head(flow, n, token):
            continue   # an LM head after a transform (BERT's decoder after dense + norm) is no MLP's down
        act_in = next((s for s in n.input_nodes if not s.startswith("param:") and s not in flow.param_views), None)
        if act_in is None:
            continue
        # outside every block, an up projection reached through the blocks' residual stream (ELECTRA's
        # embeddings_project before them, its head's dense after them) is no MLP's
        ups, ops = flow.up_matmuls(act_in, outside=n.block is None)
        ups = [u for u in ups if u.module not in claimed and u.module != n.module and u.block == n.block]
        if not ups or any((x + ".").startswith(c + ".") for c in core_modules for x in [n.module] + [u.module for u in ups]):
            continue   # linears inside an attention module are its projections, not an MLP
        mods = sorted({u.module for u in ups}, key=lambda m: [x.module for x in graph.nodes].index(m))
        base = rep_of.get(n.block, "")
        entry: dict[str, Any] = {"down": _rel(n.module, base)}
        if len(mods) >= 2 and "mul" in ops:
            gate = next((u.module for u in ups if _feeds_activation(flow, u)), mods[0])
            up = next(m for m in mods if m != gate)
            entry.update(gated=True, gate=_rel(gate, base), up=_rel(up, base))
            role[gate], role[up] = "mlp.gate", "mlp.up"
        elif len(mods) == 1 and "mul" in ops and ({"chunk", "split", "getitem", "slice"} & ops):
            entry.update(gated=True, gate_up=_rel(mods[0], base))
            role[mods[0]] = "mlp.gate_up"
        else:
            entry.update(gated=False, up=_rel(mods[0], base))
            role[mods[0]] = "mlp.up"
        role[n.module] = "mlp.down"
        container = _lca(mods + [n.module])
        entry["module"] = _rel(container, base)
        entry["hidden"] = next((m.shape[-1] for src, m in zip(n.input_nodes, n.inputs) if src == act_in), None)
        role.setdefault(container, "mlp")
        claimed.update(mods + [n.module])
        per_block[n.block]["mlp"].append(entry)

    _embeddings_head_norms(graph, flow, role, per_block, rep_of, claimed)
    routed_modules(graph, role, per_block, rep_of)
    for fqn, r in role.items():
        if fqn in graph.modules:
            graph.modules[fqn].role = r
    for b in graph.blocks:
        role[b.representative] = role.get(b.representative, "block")
        graph.modules[b.representative].role = role[b.representative]
        rep = b.representative
        inside = [(f[len(rep):], i.role) for f, i in graph.modules.items() if f == rep or f.startswith(rep + ".")]
        for m in b.member_fqns():
            for rel, r in inside:
                if m + rel in graph.modules:
                    graph.modules[m + rel].role = r
        b.roles = {k: list(v) for k, v in per_block.get(b.id, {}).items()}
    top = per_block.get(None, {})
    graph.roles = {k: list(v) for k, v in top.items()}


def _feeds_activation(flow: _Flow, node: Node, limit: int = 4) -> bool:
    frontier = [node.name]
    for _ in range(limit):
        nxt = []
        for f in frontier:
            for u in flow.users.get(f, []):
                if _base(u.op).startswith(_ACT) or "gelu" in u.op:
                    return True
                if _base(u.op).startswith(("view", "reshape", "to", "getitem", "chunk", "split", "_to_copy", "slice")):
                    nxt.append(u.name)
        frontier = nxt
    return False


def _is_token_lookup(flow: _Flow, n: Node) -> bool:
    """An embedding op reading a parameter table at indices from the model's inputs (token ids),
    not from positions (arange/cumsum)."""
    inputs = {f"input:{i['name']}" for i in flow.graph.inputs}
    return bool(n.input_nodes[1:]) and not _from_arange(flow, n.input_nodes[1]) and (
        any(s in inputs for s in n.input_nodes[1:]) or _from_inputs(flow, n.input_nodes[1], inputs))


def _is_table_lookup(n: Node) -> bool:
    return _base(n.op) == "embedding" and bool(n.input_nodes) and n.input_nodes[0].startswith("param:")


def _token_table(graph: ModelGraph, flow: _Flow) -> tuple[str, int] | None:
    """(weight FQN, vocabulary) of the first token embedding table, or None."""
    n = next((n for n in graph.nodes if _is_table_lookup(n) and _is_token_lookup(flow, n)), None)
    return (n.input_nodes[0][6:], n.inputs[0].shape[0]) if n is not None else None


def _is_head(flow: _Flow, n: Node, token: tuple[str, int] | None) -> bool:
    """A weighted matmul outside every block whose output (a vocabulary's width) reaches the
    model's outputs: the LM head."""
    if token is None or n.block is not None or not flow.weight(n):
        return False
    out_names = {o["name"] for o in flow.graph.outputs}
    reaches = n.name in out_names or any(_derived_down(flow, n.name, out_names))
    return reaches and _out_features(n) == token[1]


def _head_transform(flow: _Flow, head: Node, claimed: set[str]) -> tuple[list[str], str] | None:
    """(modules, entry) of a transform between the residual stream and the LM head, or None:
    weighted matmuls outside every block and every unit feeding the head through elementwise ops
    and norms (BERT's dense + GELU + LayerNorm, RoBERTa's). It runs replicated on the whole
    sequence as part of the head unit; ``entry`` is where the stream enters it (a sequence-sharded
    stream is gathered there): the common parent of the transform and the head (BERT's
    ``cls.predictions``, which also holds the decoder's bias), else the transform's own parent
    (ELECTRA's ``generator_predictions``), else the first matmul's module."""
    act_in = next((s for s in head.input_nodes if not s.startswith("param:") and s not in flow.param_views), None)
    if act_in is None:
        return None
    ups, _ = flow.up_matmuls(act_in)
    if not ups or any(u.block is not None or u.module in claimed or u.module == head.module for u in ups):
        return None
    mods = sorted({x.module for x in flow.walk_up(act_in) if x.module and x.block is None})
    return mods, _lca(mods + [head.module]) or _lca(mods) or ups[0].module


def _embeddings_head_norms(graph, flow, role, per_block, rep_of, claimed) -> None:
    vocab_emb = None
    for n in graph.nodes:
        if _is_table_lookup(n):
            w = n.input_nodes[0][6:]
            shape = n.inputs[0].shape
            token = _is_token_lookup(flow, n)
            kind = "embedding" if token else "position_embedding"
            role[n.module] = kind
            base = rep_of.get(n.block, "")
            entry = {"module": _rel(n.module, base), "weight": w, "vocab": shape[0], "dim": shape[1]}
            per_block[n.block][kind].append(entry)
            if token and vocab_emb is None:
                vocab_emb = entry
        elif _base(n.op).startswith(_NORM) and n.module and n.module not in role:
            info = graph.modules.get(n.module)
            if info is not None and all(len(s) == 1 for s in info.params.values()):
                role[n.module] = "norm"
                base = rep_of.get(n.block, "")
                per_block[n.block]["norms"].append(_rel(n.module, base))
        elif _base(n.op) in ("convolution", "conv2d", "conv1d", "conv3d", "_convolution"):
            role.setdefault(n.module, "conv")
    token = (vocab_emb["weight"], vocab_emb["vocab"]) if vocab_emb is not None else None
    for n in graph.nodes:
        w = flow.weight(n)
        if not w or n.block is not None or n.module in claimed:
            continue
        if not _is_head(flow, n, token):
            role.setdefault(n.module, "linear")
            continue
        tied_group = next((g for g in graph.tied_parameters if vocab_emb["weight"] in g), [])
        tied = w == vocab_emb["weight"] or w in tied_group
        role[n.module] = "lm_head"
        entry = {"module": n.module, "weight": w, "tied": tied, "vocab": _out_features(n)}
        transform = _head_transform(flow, n, claimed) if not per_block[None]["lm_head"] else None
        if transform is not None:
            entry["transform"], entry["entry"] = transform
            role.update({m: "lm_head.transform" for m in transform[0] if role.get(m) in (None, "norm", "linear")})
            # a norm inside the transform normalises the head's input, not the residual stream
            per_block[None]["norms"] = [x for x in per_block[None]["norms"] if x not in transform[0]]
        per_block[None]["lm_head"].append(entry)
    for n in graph.nodes:
        w = flow.weight(n)
        if w and n.module not in role:
            role[n.module] = "linear"


def _ancestors(flow: _Flow, name: str, limit: int = 12) -> set[str]:
    seen, frontier = set(), [name]
    for _ in range(limit):
        nxt = []
        for cur in frontier:
            if cur in seen:
                continue
            seen.add(cur)
            n = flow.by_name.get(cur)
            if n is not None:
                nxt.extend(n.input_nodes)
        frontier = nxt
    return seen


def _from_arange(flow: _Flow, name: str) -> bool:
    """Indices computed from positions (arange/cumsum), i.e. a position embedding's lookup."""
    return any(_base(flow.by_name[a].op) in ("arange", "cumsum") for a in _ancestors(flow, name) if a in flow.by_name)


def _from_inputs(flow: _Flow, name: str, inputs: set[str]) -> bool:
    return bool(_ancestors(flow, name) & inputs)


def _derived_down(flow: _Flow, name: str, targets: set[str], limit: int = 8):
    frontier = [name]
    for _ in range(limit):
        nxt = []
        for f in frontier:
            for u in flow.users.get(f, []):
                if u.name in targets:
                    yield True
                    return
                nxt.append(u.name)
        frontier = nxt
