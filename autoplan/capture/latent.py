"""Latent attention (DeepSeek's MLA): which projections give the heads, which one is broadcast.

In MLA the keys are assembled from two sources: ``kv_b_proj`` up-projects a compressed latent
into per-head ``[k_nope | v]`` (one projection behind both k and v), and a slice of
``kv_a_proj_with_mqa``'s output -- the rotary key ``k_rot``, one per token -- is broadcast
(``expand``) to every head and written beside ``k_nope``. So an upstream walk from the core's k
input finds two weighted matmuls. The per-head one is the projection k shares with v; every
other one feeds each head the same columns.

Sharding the heads then needs to know those columns: on a rank holding 1/tp of the heads, the
gradient of the broadcast columns sums only the local heads (a Partial sum over tp), while the
rest of that projection's output reaches the core through a column-sharded up-projection whose
input gradient is reduced already. Which columns reach the core without passing a weighted
matmul is read from the dataflow (:func:`broadcast_columns`), not from names.
"""
from __future__ import annotations

from typing import Any

from autoplan.capture.aliases import op_base
from autoplan.capture.ir import Node

_SPLIT = ("split", "split_with_sizes")
_KEEP_LAST = ("view", "_unsafe_view", "reshape", "unsqueeze", "to", "_to_copy")


def _pick(found: list[Node], other: list[Node]) -> Node | None:
    """The one projection of ``found`` that is the head projection: the only one, or the only one
    that also reaches ``other`` (k's projection shared with v)."""
    if len(found) == 1:
        return found[0]
    shared = [n for n in found if n.module in {o.module for o in other}]
    return shared[0] if len(shared) == 1 else None


def latent_projections(flow: Any, core: Node, qs: list[Node], ks: list[Node], vs: list[Node]):
    """((q, k, v) head projections, [(broadcast module, (start, stop))]) for an attention core whose
    q/k/v walks found ``qs``/``ks``/``vs``, or why they cannot be told apart (a string). With one
    projection each, nothing is broadcast (every attention but a latent one)."""
    if len(qs) == len(ks) == len(vs) == 1:
        return (qs[0], ks[0], vs[0]), []
    q, k, v = _pick(qs, ks + vs), _pick(ks, vs), _pick(vs, ks)
    if q is None or k is None or v is None:
        return "several projections reach its q/k/v and none is the one k shares with v"
    heads = {q.module, k.module, v.module}
    out, seen = [], set()
    for n in qs + ks + vs:
        if n.module in heads or n.module in seen:
            continue
        seen.add(n.module)
        cols = broadcast_columns(flow, n, core)
        if cols is None:
            return f"the columns of {n.module}'s output that reach its core unprojected are not one contiguous range"
        out.append((n.module, cols))
    return (q, k, v), out


def _reaches(flow: Any, name: str, target: str, limit: int = 120) -> bool:
    """Whether tensor ``name`` flows into node ``target`` without passing a weighted matmul
    (in-place writes lead on to the buffer they write into: flow.users has those edges)."""
    frontier, seen = [name], {name}
    while frontier and len(seen) < limit:
        nxt = []
        for cur in frontier:
            for u in flow.users.get(cur, []):
                if u.name == target:
                    return True
                if u.name in seen or flow.weight(u):
                    continue
                seen.add(u.name)
                nxt.append(u.name)
        frontier = nxt
    return False


def _pieces(flow: Any, proj: Node, width: int) -> list[tuple[int, int, str]]:
    """(start, stop, tensor) for each part of ``proj``'s output its users take along the last
    dimension (a split's items, a slice), or the whole output; views keeping the last
    dimension whole are followed."""
    out, frontier = [], [proj]
    for _ in range(4):
        nxt = []
        for cur in frontier:
            for u in flow.users.get(cur.name, []):
                base = op_base(u.op)
                shape = tuple(u.outputs[0].shape) if u.outputs else ()
                ndim = len(cur.outputs[0].shape) if cur.outputs else 0
                dim = u.args[2] if len(u.args) > 2 and isinstance(u.args[2], int) else 0
                last = dim in (-1, ndim - 1)
                if base in _SPLIT and last:
                    sizes = u.args[1] if isinstance(u.args[1], list) else \
                        [u.args[1]] * (width // max(int(u.args[1]), 1))
                    starts = [sum(sizes[:i]) for i in range(len(sizes))]
                    for g in flow.users.get(u.name, []):
                        i = g.args[1] if g.op == "getitem" and len(g.args) > 1 else None
                        if isinstance(i, int) and 0 <= i < len(sizes):
                            out.append((starts[i], starts[i] + sizes[i], g.name))
                elif base == "slice" and last:
                    start = u.args[3] if len(u.args) > 3 and isinstance(u.args[3], int) else 0
                    stop = min(u.args[4] if len(u.args) > 4 and isinstance(u.args[4], int) else width, width)
                    step = u.args[5] if len(u.args) > 5 else 1
                    out.append((start % width if start < 0 else start, stop if stop >= 0 else stop % width, u.name)
                               if step == 1 else (0, width, u.name))
                elif base in _KEEP_LAST and shape and shape[-1] == width:
                    nxt.append(u)
                else:
                    out.append((0, width, u.name))
        frontier = nxt
    return out


def broadcast_columns(flow: Any, proj: Node, core: Node) -> tuple[int, int] | None:
    """The output columns [start, stop) of ``proj`` that reach ``core`` without passing another
    weighted matmul, when they are one contiguous range (else None)."""
    width = proj.outputs[0].shape[-1] if proj.outputs else 0
    ranges = sorted({(a, b) for a, b, name in _pieces(flow, proj, width) if _reaches(flow, name, core.name)})
    if not ranges:
        return None
    start, stop = ranges[0]
    for a, b in ranges[1:]:
        if a > stop:
            return None
        stop = max(stop, b)
    return start, stop
