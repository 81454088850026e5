"""Graph split: pipeline stages for any model torch.export can trace, cut at module FQNs.

The model is exported (non-strict) with example inputs and unlifted, so parameters keep their
FQNs. Every op node goes to a stage by walking the graph in order: reaching a node that runs
inside a cut module (``nn_module_stack``) moves to that cut's stage, never back. torch.fx's
``split_module`` (original order kept) makes one partition per stage; we then run the top-level
graph ourselves, one stage's slice at a time. Values a later stage needs (the model input, RoPE
tables computed at the start) are passed along through the stages in between, so each stage
still takes only the previous stage's outputs. Parameters are the exported model's, registered
on the stage under their original FQNs; a weight two stages use (tied) is the same Parameter.

The exported modules are plain containers, so the TP styles (which want nn.Linear and friends)
do not apply to graph stages: use the spine split of ``split.py`` for (pp, tp).
"""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.fx.passes.split_module import split_module

from hyper_parallel.errors import StageSplitError


def _stage_of_nodes(gm: torch.fx.GraphModule, cuts: Sequence[str]) -> dict:
    found = {c: False for c in cuts}
    where, current = {}, 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        stack = [v[0] for v in (node.meta.get("nn_module_stack") or {}).values()]
        for i, c in enumerate(cuts):
            if any(f == c or f.startswith(c + ".") for f in stack):
                found[c] = True
                current = max(current, i + 1)
        where[node] = current
    missing = [c for c, ok in found.items() if not ok]
    if missing:
        raise StageSplitError(f"split_graph: no traced op runs inside {missing}; cut at module FQNs "
                              "that run in forward (e.g. 'layers.2')")
    return where


class GraphStageModule(nn.Module):
    """One stage of a graph split: the ops of its partition, parameters under original FQNs.

    ``forward(*values)`` takes the model inputs on stage 0 and the previous stage's outputs
    elsewhere, and returns the values later stages need (the model output on the last stage).
    """

    def __init__(self, stage_index: int, n_stages: int, nodes: list, live_in: list, live_out: list,
                 partitions: dict[str, nn.Module], owners: dict[str, nn.Module], buffers: dict[str, Any]):
        super().__init__()
        self.stage_index, self.n_stages = stage_index, n_stages
        self._nodes, self._live_in, self._live_out = nodes, live_in, live_out
        object.__setattr__(self, "_partitions", partitions)  # no parameters: not registered
        for path, module in sorted(owners.items()):
            self._attach(path, module)
        for name, buf in buffers.items():
            self._attach_buffer(name, buf)

    def _attach(self, path: str, module: nn.Module) -> None:
        *parents, leaf = path.split(".")
        parent: nn.Module = self
        for part in parents:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        if leaf not in parent._modules:
            parent.add_module(leaf, module)

    def _attach_buffer(self, target: str, buf: torch.Tensor) -> None:
        *parents, leaf = target.split(".")
        parent: nn.Module = self
        for part in parents:
            if part not in parent._modules:
                parent.add_module(part, nn.Module())
            parent = parent._modules[part]
        if leaf not in parent._buffers and leaf not in parent._parameters:
            parent.register_buffer(leaf, buf, persistent=False)

    def _fetch(self, target: str):
        obj: Any = self
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    def forward(self, *values):
        if len(values) != len(self._live_in):
            raise StageSplitError(f"graph stage {self.stage_index}: expected {len(self._live_in)} inputs "
                                  f"({[n.name for n in self._live_in]}), got {len(values)}")
        env = dict(zip(self._live_in, values))

        def load(a):
            return torch.fx.node.map_arg(a, lambda n: env[n])

        for node in self._nodes:
            if node.op == "get_attr":
                env[node] = self._fetch(node.target)
            elif node.op == "call_module":
                env[node] = self._partitions[node.target](*load(node.args), **load(node.kwargs))
            elif node.op == "call_function":
                env[node] = node.target(*load(node.args), **load(node.kwargs))
            elif node.op == "output":
                out = load(node.args[0])
                return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out
        out = tuple(env[n] for n in self._live_out)
        return out[0] if len(out) == 1 else out


def split_graph(model: nn.Module, example_args: Sequence[Any], cuts: Sequence[str],
                stage_indices: Sequence[int] | None = None, example_kwargs: dict | None = None
                ) -> list[GraphStageModule]:
    """Stages ``stage_indices`` (default all) of ``model`` traced with ``example_args``."""
    if example_kwargs:
        raise StageSplitError("split_graph: keyword inputs are not supported; pass tensors positionally")
    try:
        ep = torch.export.export(model, tuple(example_args), strict=False)
    except Exception as e:  # export failures come in many types; name the model
        raise StageSplitError(f"split_graph: torch.export could not trace {type(model).__name__}: {e}") from e
    gm = ep.module()
    where = _stage_of_nodes(gm, list(cuts))
    n_stages = len(cuts) + 1
    top = split_module(gm, model, lambda n: where.get(n, 0), keep_original_order=True)
    partitions = {name: mod for name, mod in top.named_children() if name.startswith("submod_")}
    # the stage of every top-level node: submod_i -> i, getitem follows its tuple, get_attr its users
    stage: dict = {}
    nodes = list(top.graph.nodes)
    for n in nodes:
        if n.op == "call_module":
            stage[n] = int(n.target.split("_")[1])
        elif n.op == "call_function" and n.target is operator.getitem:
            stage[n] = stage[n.args[0]]
    for n in nodes:
        if n.op == "get_attr":
            users = {stage[u] for u in n.users if u in stage}
            stage[n] = min(users) if users else 0
        elif n.op == "placeholder":
            stage[n] = -1
    output = next(n for n in nodes if n.op == "output")
    stage[output] = n_stages - 1
    consumers: dict = {}
    for n in nodes:
        for a in n.all_input_nodes:
            consumers.setdefault(a, set()).add(stage[n] if n.op != "get_attr" else stage[n])
    placeholders = [n for n in nodes if n.op == "placeholder"]
    live = []  # live[b]: values crossing from stage b to stage b + 1
    for b in range(n_stages - 1):
        live.append([n for n in nodes if n.op not in ("get_attr", "output") and stage[n] <= b
                     and max(consumers.get(n, {-1})) > b])
    idx = range(n_stages) if stage_indices is None else list(stage_indices)
    out = []
    for s in idx:
        if not 0 <= s < n_stages:
            raise StageSplitError(f"split_graph: stage {s} does not exist; {len(cuts)} cuts make {n_stages} stages")
        mine = [n for n in nodes if stage.get(n) == s or (n.op == "get_attr" and s in consumers.get(n, set()))]
        owners, buffers = {}, {}
        for n in mine:
            if n.op != "get_attr":
                continue
            value = gm.get_parameter(n.target) if _is_param(gm, n.target) else None
            if value is not None and "." in n.target:
                owners[n.target.rsplit(".", 1)[0]] = gm.get_submodule(n.target.rsplit(".", 1)[0])
            else:
                buffers[n.target] = _fetch(gm, n.target)
        live_in = placeholders if s == 0 else live[s - 1]
        live_out = [] if s == n_stages - 1 else live[s]
        body = [n for n in mine if n.op != "placeholder"]
        out.append(GraphStageModule(s, n_stages, body, live_in, live_out,
                                    {n.target: partitions[n.target] for n in body if n.op == "call_module"},
                                    owners, buffers))
    tied = _tied_groups(gm, nodes, consumers, n_stages)
    for m in out:
        m.tied_groups = tied
    return out


def _is_param(gm: nn.Module, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _fetch(gm: nn.Module, target: str):
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _tied_groups(gm, nodes, consumers, n_stages) -> list[dict[int, str]]:
    holders: dict[int, dict[int, str]] = {}
    for n in nodes:
        if n.op == "get_attr" and _is_param(gm, n.target):
            p = gm.get_parameter(n.target)
            for s in sorted(consumers.get(n, set())):
                holders.setdefault(id(p), {}).setdefault(s, n.target)
    return [h for h in holders.values() if len(h) > 1]
