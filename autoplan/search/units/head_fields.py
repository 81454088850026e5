"""Head counts and widths of an attention module, read from the captured graph: the attributes
its forward reshapes by (``num_heads``, ``head_dim``, a hidden size), whether its inputs arrive
with the heads already folded, and the K/V fields of its units -- what head sharding must keep
consistent on every rank. Split from structure.py, which builds the units from them.
"""
from __future__ import annotations

import math

from autoplan.capture.ir import ModelGraph


_WIDTH_WORDS = ("size", "dim", "width", "embd", "embed")


def head_attributes(graph: ModelGraph, fqn: str, a: dict) -> dict[str, int]:
    """The head counts and widths an attention module holds (captured ``size_attrs``) that its
    code may cut its projections by, with their global values: counts (named for heads, equal
    to the query or KV head count) on the module or its config, widths (equal to all query or
    all KV heads' width) on the module itself. With heads sharded they must be local
    (PrepareHeadsInput); the probe then proves the module runs and its core sees 1/tp of the heads."""
    m = graph.modules.get(fqn)
    n, kv, hd = int(a["n_heads"]), int(a["n_kv_heads"]), int(a.get("head_dim") or 0)
    out = {}
    for path, value in (m.size_attrs if m else {}).items():
        name = path.rsplit(".", 1)[-1].lower()
        widthish = any(w in name for w in _WIDTH_WORDS)
        if "head" in name and not widthish and value in (n, kv):
            out[path] = value
        elif widthish and "." not in path and hd and value != hd and value in (n * hd, kv * hd):
            out[path] = value
    return out


def folded_head_inputs(graph: ModelGraph, where: str, first: str, n_heads: int) -> bool:
    """Whether the attention module ``where`` reads a tensor made outside it whose leading
    dimension is batch x ``n_heads`` (batch: the first projection ``first``'s input): per-head
    rows folded into the batch, which must be cut to the rank's heads with them."""
    inside = lambda m: m == where or m.startswith(where + ".")   # noqa: E731
    module_of = {n.name: n.module for n in graph.nodes}
    batch = next((n.inputs[0].shape[0] for n in graph.nodes if n.module == first and n.inputs
                  and len(n.inputs[0].shape) == 3), 0)
    if not batch:
        return False
    folded = batch * n_heads
    made_outside: set[str] = set()   # tensors from outside the module, or slices/views of them
    for n in graph.nodes:
        if not inside(n.module) or n_heads <= 1:
            continue
        acts = [src for src in n.input_nodes if not src.startswith(("param:", "buffer:", "const:"))]
        base = n.op.split(".")[-2] if n.op.count(".") >= 2 else n.op
        if acts and base in ("slice", "view", "expand", "unsqueeze", "_to_copy", "to", "alias") and all(
                src.startswith("input:") or src in made_outside or (src in module_of and not inside(module_of[src]))
                for src in acts):
            made_outside.add(n.name)
            continue
        # the op combines it with per-head tensors in the same folded (batch * heads, ...) layout
        # (Bloom: baddbmm(alibi, q, k)); a table that only happens to have batch * heads rows
        # (RoPE frequencies when seq == batch * heads) meets (batch, seq, heads, ...) tensors instead.
        # Or a (heads, ., .) table added to (batch, heads, ., .) scores (MPT's ALiBi position_bias).
        folded_peers = [m for m, src in zip(n.inputs, n.input_nodes)
                        if len(m.shape) == 3 and m.shape[0] == folded and src in module_of and inside(module_of[src])]
        head_peers = [m for m, src in zip(n.inputs, n.input_nodes)
                      if len(m.shape) == 4 and m.shape[1] == n_heads and src in module_of and inside(module_of[src])]
        for meta, src in zip(n.inputs, n.input_nodes):
            outside = src.startswith("input:") or src in made_outside or \
                (src in module_of and not inside(module_of[src]))
            if outside and meta.shape and ((meta.shape[0] == folded and folded_peers) or
                                           (len(meta.shape) == 3 and meta.shape[0] == n_heads and head_peers)):
                return True
    return False


def folded_attr(graph: ModelGraph, rep: str, a: dict, where: str, attrs: dict[str, int]) -> str:
    n = int(a["n_heads"])
    counts = sorted(k for k, v in attrs.items() if v == n and "head" in k.rsplit(".", 1)[-1].lower()
                    and not any(w in k.rsplit(".", 1)[-1].lower() for w in _WIDTH_WORDS))
    if not counts or not a["module"]:
        return ""
    p = a["projections"]
    first = f"{rep}.{p.get('qkv') or p.get('q')}"
    return counts[0] if folded_head_inputs(graph, where, first, n) else ""


def kv_fields(graph: ModelGraph, rep: str, where: str, a: dict) -> dict:
    """head_dim, group_attrs, kv_params and proj_params of an attention (AttentionUnit): what a
    kv-replicated or uneven-heads plan, which keep projections whole, needs to know of it."""
    n, kv, hd = int(a["n_heads"]), int(a["n_kv_heads"]), int(a.get("head_dim") or 0)
    m = graph.modules.get(where) if a["module"] else None
    groups = {path: v for path, v in (m.size_attrs if m else {}).items()
              if "group" in path.rsplit(".", 1)[-1].lower() and kv and v == n // kv and n > kv}
    p = a["projections"]
    whole = [p["qkv"]] if "qkv" in p else [p[x] for x in "kv" if x in p]   # the modules kept whole
    kv_params = [math.prod(shape) for m in whole for shape in
                 (graph.modules[f"{rep}.{m}"].params.values() if f"{rep}.{m}" in graph.modules else ())]
    proj_params = {f"{m}.{name}": math.prod(shape) for m in {p[x] for x in p}
                   for name, shape in (graph.modules[f"{rep}.{m}"].params.items()
                                       if f"{rep}.{m}" in graph.modules else ())}
    return {"head_dim": hd, "group_attrs": groups, "kv_params": kv_params, "proj_params": proj_params}


# why a state-space mixer is no unit (capture.mixer_roles.mamba_mixers recognises it): one mixer per
# block is planned (MambaMixerParallel), inside a module of its own
