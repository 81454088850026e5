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
    ``flat_params`` (the weights' paths) and ``ffn`` F."""
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
                "flat_params": sorted(_rel(p, base) for p in shapes), "ffn": rows // experts})
            break


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
