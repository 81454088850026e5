"""Roles beyond attention and MLP, read from the dataflow: state-space (Mamba) mixers, experts held
as flat weights that capture ran at module level (DBRX), and module-level calls the probe must stand
in. Called by roles.recognise_roles with its flow (roles._Flow), role table and per-block entries."""
from __future__ import annotations

from autoplan.capture.aliases import op_base as _base
from autoplan.capture.ir import ModelGraph
from autoplan.capture.role_paths import lca as _lca, out_features as _out_features, param_shape as _param_shape
from autoplan.capture.role_paths import rel as _rel


_CONV = ("conv1d", "convolution", "_convolution")


def mamba_mixers(flow, role, per_block, rep_of, claimed) -> None:
    """State-space mixers (Mamba, Mamba-2): a depthwise 1-D convolution over the sequence (weight
    (channels, 1, width)) whose input a weighted matmul makes; the mixer is the nearest module
    holding both. Its linears are claimed (in_proj -> conv -> scan -> gated out_proj would
    otherwise read as a gated MLP, and sharding it as one trains wrong)."""
    graph = flow.graph
    for n in graph.nodes:
        if _base(n.op) not in _CONV or len(n.input_nodes) < 2 or not n.input_nodes[1].startswith("param:"):
            continue
        weight = n.input_nodes[1][6:]
        shape = _param_shape(graph, weight)
        if len(shape) != 3 or shape[1] != 1:
            continue
        ins, _ = flow.up_matmuls(n.input_nodes[0])
        if not ins:
            continue
        mixer = _lca([ins[0].module, weight.rpartition(".")[0]])
        if not mixer or mixer in role:
            continue
        inside = sorted({m.module for m in graph.nodes if flow.weight(m) and (m.module + ".").startswith(mixer + ".")})
        base = rep_of.get(n.block, "")
        role[mixer] = "mamba"
        for m in inside:
            if m != mixer:
                role[m] = "mamba.linear"
        role[weight.rpartition(".")[0]] = "mamba.conv"
        for fqn in graph.modules:   # its norms (Jamba's dt/B/C norms) see the mixer's activations, not the stream
            if fqn.startswith(mixer + "."):
                role.setdefault(fqn, "mamba.part")
        claimed.update(inside)
        per_block[n.block]["mamba"].append({"module": _rel(mixer, base), "in_proj": _rel(ins[0].module, base),
                                            "linears": [_rel(m, base) for m in inside],
                                            "channels": shape[0]})


def flat_experts(flow, role, per_block, rep_of, claimed) -> None:
    """Experts a capture could only run at module level (routing by data-dependent token counts:
    DBRX's), so no top-k reaches them in the graph: a module-level call inside a block whose 2-D
    weights all have E x F rows, beside a weighted matmul with E outputs in the same container
    (the router). Recorded as a ``moe`` entry with
    ``flat_params`` (the weights' paths), ``ffn`` F and ``routing_weights``: the bytes of the call's
    routing weights (its floating input shaped like its integer expert indices: tokens x top-k) over
    those of its hidden states, as [numerator, denominator] -- the split experts all-reduce the
    weights' gradient in backward, sized by it (FlatExpertsParallel copies them into the split)."""
    graph = flow.graph
    known = {(b, e["experts"]) for b, entries in per_block.items() for e in entries.get("moe", [])}
    for n in graph.nodes:
        if not n.op.startswith("module:") or n.block is None or not n.module or "." not in n.module:
            continue
        mod, base = n.module, rep_of.get(n.block, "")
        if (n.block, _rel(mod, base)) in known:
            continue
        shapes = {f"{f}.{p}": s for f, info in graph.modules.items() if f == mod or f.startswith(mod + ".")
                  for p, s in info.params.items()}
        if len(shapes) < 2 or any(len(s) != 2 for s in shapes.values()) or len({s[0] for s in shapes.values()}) != 1:
            continue
        parent = mod.rpartition(".")[0]
        rows = next(iter(shapes.values()))[0]
        for r in graph.nodes:
            experts = _out_features(r)
            if r.block != n.block or not flow.weight(r) or r.module in claimed or \
                    not r.module.startswith(parent + ".") or r.module.startswith(mod + ".") or \
                    experts < 2 or rows % experts or rows // experts < 2:
                continue
            role[r.module], role[mod] = "moe.router", "moe.experts"
            role.setdefault(parent, "moe")
            claimed.add(r.module)
            per_block[n.block]["moe"].append({
                "module": _rel(parent, base), "router": _rel(r.module, base), "experts": _rel(mod, base),
                "num_experts": experts, "top_k": None, "expert_params": [],
                "flat_params": sorted(_rel(p, base) for p in shapes), "ffn": rows // experts,
                "routing_weights": _routing_weights(n.inputs)})
            break


def _routing_weights(inputs) -> list[int] | None:
    """[routing-weight bytes, hidden-state bytes] of an experts call ``(hidden, top_k_index,
    top_k_weights)``: a floating input of the integer one's shape, the hidden states first."""
    if len(inputs) < 3 or not inputs[0].dtype.split(".")[-1].startswith(("float", "bfloat")):
        return None
    index = next((t for t in inputs[1:] if "int" in t.dtype.split(".")[-1]), None)
    weights = next((t for t in inputs[1:] if index is not None and t is not index and tuple(t.shape) == tuple(index.shape)
                    and "float" in t.dtype.split(".")[-1]), None)
    if weights is None or not inputs[0].nbytes:
        return None
    return [weights.nbytes, inputs[0].nbytes]


def routed_modules(graph: ModelGraph, role, per_block, rep_of) -> None:
    """Modules inside blocks that capture ran at module level (hooks: they read data-dependent
    values, as experts routed by token counts do -- DBRX's) whose output is shaped like their first
    input: the probe runs a shape-true stand-in for them (``routed`` entries), as for recognised
    experts, so the block's other units can still be checked. Never one inside an attention or an
    MLP: standing in part of a unit would hide from the probe what its styles do to that part."""
    calls = [n for n in graph.nodes if n.op.startswith("module:") and n.block is not None and n.module]
    fqns = {n.module for n in calls}
    units = [m for m, r in role.items() if r.split(".")[0] in ("attention", "mlp")]
    for n in calls:
        if any(f.startswith(n.module + ".") for f in fqns) or not n.inputs or not n.outputs:
            continue   # the innermost ones only
        if any(n.module == u or n.module.startswith(u + ".") for u in units):
            continue
        if tuple(n.outputs[0].shape) == tuple(n.inputs[0].shape):
            entry = _rel(n.module, rep_of.get(n.block, ""))
            if entry not in per_block[n.block]["routed"]:
                per_block[n.block]["routed"].append(entry)


def paired_experts(flow, role, per_block, rep_of, claimed) -> None:
    """Experts held as two modules of stacked 3-D weights (E, ., .) that capture ran at module
    level (JetMoE's ``input_linear`` / ``output_linear``: routing by data-dependent token counts)
    inside a container call whose output is shaped like its input (an MLP: hidden in, hidden out)
    and in which the only other weights are a router with E outputs (and the container's own
    1-D bias). The up module takes the hidden width H in; the down module gives it back; the up
    output is ``packed`` x the down input (2: [gate|up] chunked). Which weight dimension is that
    width is read from the shapes. Recorded as a ``moe`` entry with ``paired`` (the arguments of
    PairedExpertsParallel) and ``ffn`` F. A mixture of attention experts (JetMoE's MoA) is no
    match: its container is never called itself, and the attention around it holds other weights."""
    graph = flow.graph
    calls = [n for n in graph.nodes if n.op.startswith("module:") and n.block is not None and n.module]
    known = {(b, e["module"]) for b, entries in per_block.items() for e in entries.get("moe", [])}
    outer: list = []   # module-level calls holding stacked experts beside other weights
    for c in calls:
        base = rep_of.get(c.block, "")
        if (c.block, _rel(c.module, base)) in known or not c.inputs or not c.outputs or \
                tuple(c.inputs[0].shape) != tuple(c.outputs[0].shape):
            continue
        hidden = c.inputs[0].shape[-1]
        inside = {f: info for f, info in graph.modules.items() if f.startswith(c.module + ".") and info.params}
        experts = {n.module: n for n in calls if n.module in inside and len(inside[n.module].params) == 1
                   and len(next(iter(inside[n.module].params.values()))) == 3 and n.inputs and n.outputs}
        counts = {next(iter(inside[m].params.values()))[0] for m in experts}
        if experts and c.block is not None:
            outer.append(c)
        if len(experts) != 2 or len(counts) != 1:
            continue
        e = counts.pop()
        routers = [r for r in graph.nodes if flow.weight(r) and r.module in inside and r.module not in experts
                   and _out_features(r) == e]
        own = graph.modules.get(c.module)
        if len(routers) != 1 or set(inside) != set(experts) | {routers[0].module} or \
                (own and any(len(s) != 1 for s in own.params.values())):
            continue
        ups = [n for n in experts.values() if n.inputs[0].shape[-1] == hidden]
        downs = [n for n in experts.values() if n.outputs[0].shape[-1] == hidden and n not in ups]
        if len(ups) != 1 or len(downs) != 1:
            continue
        up, down = ups[0], downs[0]
        width, ffn = up.outputs[0].shape[-1], down.inputs[0].shape[-1]
        if ffn < 2 or width % ffn or width // ffn not in (1, 2):
            continue
        up_dim = _width_dim(next(iter(inside[up.module].params.values())), width, hidden)
        down_dim = _width_dim(next(iter(inside[down.module].params.values())), ffn, hidden)
        if up_dim is None or down_dim is None:
            continue
        tokens = max(c.inputs[0].numel // hidden, 1)
        top_k = up.inputs[0].shape[0] // tokens if up.inputs[0].shape[0] % tokens == 0 else None
        weight = next(iter(inside[up.module].params))
        role[routers[0].module], role[c.module] = "moe.router", "moe"
        role[up.module] = role[down.module] = "moe.experts"
        claimed.update([routers[0].module, up.module, down.module])
        per_block[c.block]["moe"].append({
            "module": _rel(c.module, base), "router": _rel(routers[0].module, base), "experts": _rel(c.module, base),
            "num_experts": e, "top_k": top_k, "expert_params": [], "ffn": ffn,
            "paired": {"up": up.module[len(c.module) + 1:], "down": down.module[len(c.module) + 1:],
                       "up_dim": up_dim, "down_dim": down_dim, "packed": width // ffn, "weight": weight}})
    # no MoE container itself, nor inside one, nor a mixture of attention heads moa_roles read: such an
    # attention whose heads could not be read (no position table giving the head width)
    for c in outer:
        if role.get(c.module) in ("moe", "attention") or \
                any(role.get(f) == "moe" and c.module.startswith(f + ".") for f in role) \
                or any(o.module.startswith(c.module + ".") and role.get(o.module) != "moe" for o in outer):
            continue   # the innermost such call only (the attention, not the block around it)
        base = rep_of.get(c.block, "")
        per_block[c.block]["routed_untraced"].append({
            "module": _rel(c.module, base),
            "why": "it runs stacked expert weights routed by token counts read from the data beside other weights "
                   "(a mixture of attention heads: per-expert query projections); capture ran it at module level, so "
                   "its heads and projections are not read and it stays replicated"})


def _width_dim(shape, width: int, hidden: int) -> int | None:
    """The dimension (1 or 2) of an (E, ., .) weight holding ``width``, the other holding ``hidden``;
    None when that is not so or is ambiguous (width == hidden)."""
    dims = [d for d in (1, 2) if shape[d] == width and shape[3 - d] == hidden]
    return dims[0] if len(dims) == 1 else None
