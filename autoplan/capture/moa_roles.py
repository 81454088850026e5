"""A mixture of attention heads (JetMoE's MoA) read from the dataflow and the shapes: an attention
that capture ran at module level (its routing reads token counts from the data), recognised so
its heads can be sharded like any attention's (hyper_parallel's PairedExpertsParallel on its
query experts, ColwiseParallel on the shared K/V projection; autoplan.search.tp.moa_strategies).

What it is, read from the graph and never from a class name:

- a module-level call inside a block whose output is shaped like its first input (hidden in,
  hidden out) and which holds, among its submodules,
- an up and a down module of stacked 3-D weights (E, ., .) with the same E, each called at module
  level: the up takes the hidden width H in and gives the query width D (the routed tokens' query
  heads), the down takes D back to H -- the per-expert query and output projections;
- a router: a weighted matmul with E outputs;
- the shared key/value projection: one weighted matmul reading the call's own input with 2 x D
  outputs ([k | v]; ``kv_packed`` 2) or two with D each;
- no other weights but 1-D ones (a bias added after the experts).

Its heads: the head width is the last dimension of a position table the call receives (the
rotary cos/sin its core applies per head), confirmed by a width attribute of the module when it
holds one; D / head width are the KV heads, times top-k (the copies of each token, read from the
up module's row count) the query heads the core runs. When the width cannot be read the module
stays ``routed_untraced`` (replicated, with the reason).
"""
from __future__ import annotations

from autoplan.capture.role_paths import out_features as _out_features
from autoplan.capture.role_paths import rel as _rel


def mixture_of_heads(flow, role, per_block, rep_of, claimed) -> None:
    """Record each mixture of attention heads as an ``attention`` entry with ``moa`` (see module
    docstring); its projections are claimed, so no MLP or MoE reading takes them."""
    graph = flow.graph
    calls = [n for n in graph.nodes if n.op.startswith("module:") and n.block is not None and n.module]
    for c in calls:
        entry = _read(flow, c, calls)
        if entry is None:
            continue
        base = rep_of.get(c.block, "")
        moa, names = entry
        role[c.module] = "attention"
        role[names["router"]] = "attention.router"
        role[names["up"]] = "attention.q"
        role[names["down"]] = "attention.o"
        for kv in names["kv"]:
            role[kv] = "attention.kv"
        claimed.update([names["router"], names["up"], names["down"], *names["kv"]])
        kv = names["kv"]
        per_block[c.block]["attention"].append({
            "module": _rel(c.module, base),
            "projections": {"q": _rel(names["up"], base), "k": _rel(kv[0], base), "v": _rel(kv[-1], base),
                            "o": _rel(names["down"], base)},
            "n_heads": moa.pop("n_heads"), "n_kv_heads": moa.pop("n_kv_heads"), "head_dim": moa["head_dim"],
            "op": c.op, "moa": {**moa, "experts": _rel(names["experts"], base), "router": _rel(names["router"], base),
                                "kv": [_rel(k, base) for k in kv]}})


def _read(flow, c, calls):
    """(moa fields, module names) of call ``c`` when it is a mixture of attention heads, else None."""
    graph = flow.graph
    if not c.inputs or not c.outputs or tuple(c.inputs[0].shape) != tuple(c.outputs[0].shape):
        return None
    hidden = c.inputs[0].shape[-1]
    inside = {f: info for f, info in graph.modules.items() if f.startswith(c.module + ".") and info.params}
    stacked = {n.module: n for n in calls if n.module in inside and len(inside[n.module].params) == 1
               and len(next(iter(inside[n.module].params.values()))) == 3 and n.inputs and n.outputs}
    if len(stacked) != 2 or len({next(iter(inside[m].params.values()))[0] for m in stacked}) != 1:
        return None
    e = next(iter(inside[next(iter(stacked))].params.values()))[0]
    ups = [n for n in stacked.values() if n.inputs[0].shape[-1] == hidden]
    # square weights (D == H): the up is the one called first (it makes the queries)
    ups = ups if len(ups) == 1 else sorted(ups, key=lambda n: graph.nodes.index(n))[:1]
    downs = [n for n in stacked.values() if n not in ups and n.outputs[0].shape[-1] == hidden]
    if len(ups) != 1 or len(downs) != 1:
        return None
    up, down = ups[0], downs[0]
    width = up.outputs[0].shape[-1]
    if down.inputs[0].shape[-1] != width or width < 2:
        return None
    weighted = [n for n in graph.nodes if flow.weight(n) and n.module in inside and n.module not in stacked]
    routers = [n for n in weighted if _out_features(n) == e]
    kvs = [n for n in weighted if n not in routers and n.input_nodes and n.input_nodes[0] == c.input_nodes[0]]
    if len(routers) != 1 or len(kvs) not in (1, 2) or len(kvs) + 1 != len(weighted) or \
            sum(_out_features(n) for n in kvs) != 2 * width or len({_out_features(n) for n in kvs}) != 1:
        return None
    holders = set(stacked) | {n.module for n in weighted}
    if any(len(s) != 1 for f, info in inside.items() if f not in holders for s in info.params.values()):
        return None   # other weights than a bias: not only heads, router and projections
    own = graph.modules.get(c.module)
    if own and any(len(s) != 1 for s in own.params.values()):
        return None
    head_dim = _head_width(graph, c, width)
    if not head_dim:
        return None
    tokens = max(c.inputs[0].numel // hidden, 1)
    top_k = up.inputs[0].shape[0] // tokens if up.inputs[0].shape[0] % tokens == 0 else 0
    if top_k < 1:
        return None
    up_dims = _width_dims(next(iter(inside[up.module].params.values())), width, hidden, first=1)
    down_dims = _width_dims(next(iter(inside[down.module].params.values())), width, hidden, first=2)
    experts = up.module.rpartition(".")[0] if up.module.rpartition(".")[0] == down.module.rpartition(".")[0] else ""
    if not experts or not up_dims or not down_dims:
        return None
    kv_heads = width // head_dim
    # the container's stored widths of the query heads (JetMoE's ``hidden_size``, which sizes its
    # buffers); with square weights the one naming the input is the hidden width, not the heads'
    held = graph.modules[experts].size_attrs if experts in graph.modules else {}
    local = sorted(k for k, v in held.items() if "." not in k and v == width and
                   (width != hidden or "input" not in k.lower()))
    moa = {"n_heads": top_k * kv_heads, "n_kv_heads": kv_heads, "head_dim": head_dim, "top_k": top_k,
           "num_experts": e, "width": width, "hidden": hidden,
           "up": up.module[len(experts) + 1:], "down": down.module[len(experts) + 1:],
           "up_dims": up_dims, "down_dims": down_dims, "kv_packed": 2 if len(kvs) == 1 else 1,
           "local_attributes": local,
           "weight": next(iter(inside[up.module].params))}
    return moa, {"router": routers[0].module, "up": up.module, "down": down.module, "experts": experts,
                 "kv": [n.module for n in kvs]}


def _head_width(graph, c, width: int) -> int:
    """The width of one head: the last dimension of a floating table (batch, seq, width) the call
    receives besides its hidden input (the rotary cos/sin applied per head) that divides
    ``width``; a width attribute of the module (``head_dim``) must agree when it holds one."""
    tables = {m.shape[-1] for m in c.inputs[1:]
              if len(m.shape) >= 3 and "float" in m.dtype and m.shape[-1] < width and width % m.shape[-1] == 0}
    attrs = graph.modules[c.module].size_attrs if c.module in graph.modules else {}
    named = {v for k, v in attrs.items() if "." not in k and "head" in k.lower() and "dim" in k.lower()}
    if len(tables) == 1 and (not named or named == tables):
        return tables.pop()
    return 0


def _width_dims(shape, width: int, hidden: int, first: int) -> list[int]:
    """The candidate dimensions (1 or 2) of an (E, ., .) weight holding ``width`` (the other holding
    ``hidden``): one when the shapes tell, both when the weight is square -- ``first`` (where
    ``F.linear``'s (E, out, in) holds it) before the other, the probe rejecting the one the
    module's code does not run with."""
    dims = [d for d in (1, 2) if shape[d] == width and shape[3 - d] == hidden]
    return sorted(dims, key=lambda d: d != first)
