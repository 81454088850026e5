"""Deferred weight gradients: the dx pass records what the dw pass needs, so dw costs only dw.

During the input-gradient pass (I) autograd walks from the stage outputs to the stage inputs.
Every parameter reaches that walk through some node on it (the matmul that used the weight);
a pre-hook on those nodes records the gradient flowing into them. The weight pass (W) then asks
autograd for the parameter gradients starting from those recorded gradients only, so it runs the
weight half of each op and not the whole backward again.

When the trick does not apply (no stage input needs a gradient, as on the first stage; or a
parameter whose path to the output never touches the input path) the caller falls back to a
plain backward in W.
"""
from __future__ import annotations

from collections import defaultdict, deque
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.tensor import DTensor


def grad_node(t: torch.Tensor) -> Node | None:
    """The autograd node that produces ``t``'s gradient (the accumulator for a leaf)."""
    if not t.requires_grad:
        return None
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a view creates the leaf's accumulator


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """node -> the nodes whose backward feeds it (its users in the forward graph)."""
    users: dict[Node, list[Node]] = defaultdict(list)
    seen, todo = set(roots), deque(roots)
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return users


def _downstream(starts: Sequence[Node], users, stop: set | None = None) -> tuple[set, set]:
    """Nodes reachable forward from ``starts``; with ``stop``, the stop nodes met are returned
    separately and not crossed."""
    reached, met = set(starts), set()
    todo = deque(starts)
    while todo:
        for user in users.get(todo.popleft(), []):
            if user in reached:
                continue
            if stop is not None and user in stop:
                met.add(user)
                continue
            reached.add(user)
            todo.append(user)
    return reached, met


class DeferredWeightGrad:
    """What one micro-batch's W needs: groups of (parameters, the dx-path nodes they feed), and
    the gradients recorded at those nodes during I.

    Parameters are asked for group by group: a group's parameters are reachable from its own
    nodes only through their weight branch, so autograd does no dx work again. When a group has
    several nodes and one lies below another, the lower one's recorded gradient replaces what
    flows into it, so nothing is counted twice.
    """

    def __init__(self, groups: list[tuple[list[torch.Tensor], list[Node], list[Node]]]):
        self.groups = groups
        self.grads: dict[Node, tuple] = {}

    @property
    def taps(self) -> list[Node]:
        return [n for _, _, taps in self.groups for n in taps]

    def run(self) -> None:
        for params, nodes, taps in self.groups:
            edges, outs = [], []
            for node in taps:
                for i, g in enumerate(self.grads.get(node, ())):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        outs.append(g)
            if not edges:
                continue
            handles = [node.register_prehook(lambda _g, saved=self.grads.get(node): saved)
                       for node in taps] if len(taps) > 1 else []
            try:
                got = torch.autograd.grad(edges, [GradientEdge(n, 0) for n in nodes], grad_outputs=outs,
                                          allow_unused=True, retain_graph=len(self.groups) > 1)
            finally:
                for h in handles:
                    h.remove()
            with torch.no_grad():
                for p, g in zip(params, got):
                    if g is None:
                        continue
                    if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                        # what reaches a parameter's accumulator can be a partial sum (a replicated
                        # norm weight on a sequence shard); a full backward hands AccumulateGrad the
                        # reduced gradient, in the parameter's placements -- so does this pass
                        g = g.redistribute(p.device_mesh, p.placements)
                    if p.grad is None:
                        p.grad = g
                    else:
                        p.grad += g
        self.grads.clear()


def _group(params, p_nodes, taps_of) -> list[tuple[list, list, list]]:
    """Merge parameters whose tap sets overlap into one group (parameters and nodes are told
    apart by identity and position only)."""
    groups: list[tuple[list, list, set]] = []
    for p, n in zip(params, p_nodes):
        taps = taps_of.get(n)
        if not taps:
            continue
        hit = [i for i, g in enumerate(groups) if g[2] & taps]
        merged = ([p], [n], set(taps))
        for i in hit:
            merged[0].extend(groups[i][0])
            merged[1].extend(groups[i][1])
            merged[2].update(groups[i][2])
        # by position, never ``groups.remove``: that compares groups with ``==``, which compares
        # their parameters element-wise (an error for tensors with more than one value, and for a
        # torch.Tensor beside a DTensor -- Nemotron at pp=2 x tp=2 crashed here)
        groups = [g for i, g in enumerate(groups) if i not in hit]
        groups.append(merged)
    return [(ps, ns, sorted(ts, key=id)) for ps, ns, ts in groups]


def input_backward(roots: list[torch.Tensor], grads: list | None, inputs: list[torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[list, DeferredWeightGrad | None]:
    """dx of ``inputs``; also a DeferredWeightGrad for ``params`` if every parameter the graph
    uses can be reached from the dx path (else None: the caller runs a plain backward for W)."""
    params = [p for p in params if p.requires_grad]
    root_nodes = [n for n in (grad_node(r) for r in roots) if n is not None]
    in_nodes = [n for n in (grad_node(x) for x in inputs) if n is not None]
    users = _consumers(root_nodes)
    dx_path, _ = _downstream(in_nodes, users)
    p_nodes = [grad_node(p) for p in params]
    taps_of: dict = {}
    complete = True
    for n in p_nodes:
        if n not in users:
            continue  # this micro-batch does not use the parameter
        _, met = _downstream([n], users, stop=dx_path)
        complete &= bool(met)
        taps_of[n] = met
    deferred = DeferredWeightGrad(_group(params, p_nodes, taps_of)) if complete else None
    handles = []
    if deferred is not None:
        for node in deferred.taps:
            handles.append(node.register_prehook(
                lambda grad_outputs, node=node: deferred.grads.__setitem__(node, grad_outputs)))
    try:
        dx = torch.autograd.grad(roots, inputs, grad_outputs=grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return list(dx), deferred
