"""Views of a ModelGraph for its two consumers.

- The cost model: :func:`distinct_ops`, every distinct op call with its count, re-runnable.
- The planner: :func:`module_summary` (one row per module) and :func:`block_dataflow` (the
  ordered leaf-module calls and functional ops of a block, with their tensor links).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterator

import pandas as pd
import torch

from autoplan.capture.ir import BlockGroup, ModelGraph, Node, TensorMeta
from cost_models.errors import CostModelError
from cost_models.ops import REPLAY_DEVICE, OpSpec, TensorSpec, dedupe


@dataclass
class DistinctOp:
    """One distinct op call: ``op`` (e.g. ``"aten.linear.default"``), its tensor inputs,
    its non-tensor args, and how many times it runs in one forward (blocks multiplied out)."""

    op: str
    inputs: list[TensorMeta]
    args: list[Any]
    kwargs: dict[str, Any]
    count: int
    flops_fwd: int
    flops_bwd: int
    bytes_read: int
    bytes_written: int
    requires_grad: list[bool] = field(default_factory=list)
    example: str = ""

    def resolve(self):
        """The callable ``torch.ops`` overload for :attr:`op`."""
        ns, name, overload = self.op.split(".") if self.op.count(".") == 2 else (*self.op.split("."), "default")
        return getattr(getattr(getattr(torch.ops, ns), name), overload)

    def build(self, device: str | torch.device = "cpu", requires_grad: bool = False) -> tuple[list, dict]:
        """(args, kwargs) with fresh tensors of the recorded shapes/dtypes/strides on ``device``.

        Floating tensors are random normal, integer ones are zero (valid indices everywhere).
        """
        made = []
        for i, m in enumerate(self.inputs):
            t = _fresh_tensor(m, device)
            if requires_grad and t.is_floating_point() and i < len(self.requires_grad) and self.requires_grad[i]:
                t.requires_grad_(True)
            made.append(t)

        def fill(a):
            if isinstance(a, dict) and set(a) == {"tensor"}:
                return made[a["tensor"]]
            if isinstance(a, dict) and "dtype" in a and len(a) == 1:
                return getattr(torch, a["dtype"].split(".")[-1])
            if isinstance(a, dict) and "device" in a and len(a) == 1:
                return torch.device(device)
            if isinstance(a, dict) and "enum" in a:
                return getattr(torch, a["enum"].split(".")[-1])
            if isinstance(a, list):
                return [fill(x) for x in a]
            if isinstance(a, dict):
                return {k: fill(v) for k, v in a.items()}
            return a

        return fill(self.args), {k: fill(v) for k, v in self.kwargs.items()}

    def run(self, device: str | torch.device = "cpu"):
        """Build the arguments on ``device`` and call the op once; returns its output."""
        args, kwargs = self.build(device)
        return self.resolve()(*args, **kwargs)


def _fresh_tensor(m: TensorMeta, device) -> torch.Tensor:
    """A tensor with ``m``'s shape, dtype and strides (expanded, stride-0 layouts included):
    random normal when floating, ones when bool, zeros otherwise (valid indices everywhere)."""
    dtype = getattr(torch, m.dtype.split(".")[-1])
    stride = tuple(m.stride) if m.stride and len(m.stride) == len(m.shape) else None
    if stride is None:
        size, shape = None, m.shape
    else:
        size = 0 if 0 in m.shape else 1 + sum((s - 1) * st for s, st in zip(m.shape, stride))
        shape = (size,)
    if dtype.is_floating_point or dtype.is_complex:
        base = torch.randn(shape, dtype=dtype, device=device)
    elif dtype == torch.bool:
        base = torch.ones(shape, dtype=dtype, device=device)
    else:
        base = torch.zeros(shape, dtype=dtype, device=device)
    return base if stride is None else base.as_strided(m.shape, stride)


def distinct_ops(graph: ModelGraph) -> list[DistinctOp]:
    """Distinct (op, input metas, non-tensor args) with counts; getitem and module-level nodes
    (hook fallback) are left out because they are not ops one can re-run."""
    table: dict[str, DistinctOp] = {}
    rg_of = {n.name: n.requires_grad for n in graph.nodes}
    for n in graph.nodes:
        if n.op == "getitem" or n.op.startswith("module:"):
            continue
        key = json.dumps([n.op, [(m.shape, m.dtype, m.stride) for m in n.inputs], n.args, n.kwargs], default=str)
        entry = table.get(key)
        if entry is None:
            entry = table[key] = DistinctOp(
                op=n.op,
                inputs=list(n.inputs),
                args=n.args,
                kwargs=n.kwargs,
                count=0,
                flops_fwd=n.flops_fwd,
                flops_bwd=n.flops_bwd,
                bytes_read=n.bytes_read,
                bytes_written=n.bytes_written,
                requires_grad=[src.startswith("param:") or rg_of.get(src, False) for src in n.input_nodes],
                example=n.name,
            )
        entry.count += graph.multiplicity(n)
    return sorted(table.values(), key=lambda d: (-d.count, d.op))


def saved_items(graph: ModelGraph, nodes: list[Node], by_name: dict[str, Node]) -> Iterator[tuple[str, int]]:
    """(module that made it, bytes) of every tensor ``nodes`` keep for backward, each once: a
    node's internal buffers under its own module, a saved tensor under its producer's (a graph
    input under ""). Who made a saved tensor says how a shard divides it -- a latent attention
    keeps its latents whole on every rank and its per-head tensors split
    (autoplan.search.units.structure)."""
    seen: set[str] = set()
    for n in nodes:
        if n.saved_internal_bytes:
            yield n.module, n.saved_internal_bytes
        for src in n.saves:
            if src in seen:
                continue
            seen.add(src)
            prod = by_name.get(src)
            if prod is not None and prod.outputs:
                yield prod.module, prod.outputs[0].nbytes
            elif src.startswith("input:"):
                meta = next((i for i in graph.inputs if f"input:{i['name']}" == src), None)
                if meta:
                    yield "", TensorMeta(tuple(meta["shape"]), meta["dtype"]).nbytes


def _activation_saved(graph: ModelGraph, nodes: list[Node], by_name: dict[str, Node]) -> int:
    return sum(nbytes for _, nbytes in saved_items(graph, nodes, by_name))


def _boundary(nodes: list[Node], all_users: dict[str, list[str]], output_names: set[str]):
    inside = {n.name for n in nodes}
    ins, outs = [], []
    for n in nodes:
        for src, m in zip(n.input_nodes, n.inputs):
            if src not in inside and not src.startswith(("param:", "buffer:", "const:")) and m.shape not in ins:
                ins.append(m.shape)
    for n in nodes:
        if any(u not in inside for u in all_users.get(n.name, [])) or n.name in output_names:
            for m in n.outputs[:1]:
                if m.shape not in outs:
                    outs.append(m.shape)
    return ins, outs


def module_summary(graph: ModelGraph) -> pd.DataFrame:
    """One row per module that owns traced ops (representatives stand for their block).

    Columns: fqn, type, role, block, count (times it runs per forward), params (own and
    below, FQN -> shape), num_params, input_shapes / output_shapes (activations crossing the
    module boundary), flops_fwd / flops_bwd (one call, including submodules), saved_bytes
    (activation bytes kept for backward by its ops, each tensor once), bytes_read/bytes_written.
    """
    users: dict[str, list[str]] = {}
    for n in graph.nodes:
        for src in n.input_nodes:
            users.setdefault(src, []).append(n.name)
    by_name = {n.name: n for n in graph.nodes}
    output_names = {o["name"] for o in graph.outputs}
    owned: dict[str, list[Node]] = {}
    for n in graph.nodes:
        for fqn in set(n.scope) | {n.module}:
            owned.setdefault(fqn, []).append(n)
    rows = []
    for fqn, nodes in owned.items():
        info = graph.modules.get(fqn)
        params = {}
        if info is not None:
            prefix = f"{fqn}." if fqn else ""
            for sub, sinfo in graph.modules.items():
                if sub == fqn or sub.startswith(prefix):
                    for p, s in sinfo.params.items():
                        params[f"{sub}.{p}" if sub else p] = s
        ins, outs = _boundary(nodes, users, output_names)
        block = nodes[0].block if fqn != "" and all(n.block == nodes[0].block for n in nodes) else None
        rows.append(
            {
                "fqn": fqn,
                "type": info.type if info else nodes[0].module_type,
                "role": info.role if info else None,
                "block": block,
                "count": graph.block(block).count if block else 1,
                "num_params": sum(_numel(s) for s in params.values()),
                "params": params,
                "input_shapes": ins,
                "output_shapes": outs,
                "flops_fwd": sum(n.flops_fwd * (graph.multiplicity(n) if block is None else 1) for n in nodes),
                "flops_bwd": sum(n.flops_bwd * (graph.multiplicity(n) if block is None else 1) for n in nodes),
                "saved_bytes": _activation_saved(graph, nodes, by_name),
                "bytes_read": sum(n.bytes_read for n in nodes),
                "bytes_written": sum(n.bytes_written for n in nodes),
            }
        )
    df = pd.DataFrame(rows)
    return df.sort_values("fqn", kind="stable").reset_index(drop=True) if not df.empty else df


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class FlowStep:
    """One step of a block's dataflow: a leaf-module call (``kind="module"``) or a functional op.

    ``inputs`` name where each activation comes from: an earlier step id or ``"block_input"``
    (plus the producing node name after a colon); ``nodes`` are the IR nodes the step covers.
    """

    id: int
    kind: str
    name: str
    role: str | None
    op: str
    inputs: list[str]
    input_shapes: list[tuple[int, ...]]
    output_shapes: list[tuple[int, ...]]
    args: list[Any]
    nodes: list[str]


def block_dataflow(graph: ModelGraph, block: str | BlockGroup | None = None) -> list[FlowStep]:
    """Ordered steps of the block's representative (``block=None``: the part outside blocks).

    Consecutive ops of one leaf module (a module with parameters and no submodule with ops,
    e.g. a Linear, an Embedding, a norm) collapse into one ``module`` step; every other op
    (residual add, view into heads, RoPE, SwiGLU mul, softmax/SDPA) is its own ``op`` step.
    """
    bid = block.id if isinstance(block, BlockGroup) else block
    nodes = [n for n in graph.nodes if n.block == bid]
    leaf = {}
    for fqn, info in graph.modules.items():
        subs = [graph.modules[c] for c in info.children if c in graph.modules]
        if info.params and not any(c.params or c.children for c in subs):
            leaf[fqn] = info
    steps: list[FlowStep] = []
    step_of: dict[str, int] = {}
    for n in nodes:
        owner = next((s for s in reversed(n.scope) if s in leaf), None)
        last = steps[-1] if steps else None
        if owner is not None and last and last.kind == "module" and last.name == owner and _continues(last, n, step_of):
            step = steps[-1]
            step.nodes.append(n.name)
            step.output_shapes = [m.shape for m in n.outputs]
            step_of[n.name] = step.id
            for src, m in zip(n.input_nodes, n.inputs):
                ref = _ref(src, step_of)
                if ref is not None and step_of.get(src) != step.id and ref not in step.inputs:
                    step.inputs.append(ref)
                    step.input_shapes.append(m.shape)
            continue
        refs, shapes = [], []
        for src, m in zip(n.input_nodes, n.inputs):
            ref = _ref(src, step_of)
            if ref is not None:
                refs.append(ref)
                shapes.append(m.shape)
        step = FlowStep(
            id=len(steps),
            kind="module" if owner else "op",
            name=owner or n.name,
            role=graph.modules[owner].role if owner else None,
            op=leaf[owner].type if owner else n.op,
            inputs=refs,
            input_shapes=shapes,
            output_shapes=[m.shape for m in n.outputs],
            args=n.args,
            nodes=[n.name],
        )
        steps.append(step)
        step_of[n.name] = step.id
    return steps


def _continues(step: FlowStep, n: Node, step_of: dict[str, int]) -> bool:
    """A node continues a module step when it reads something that step produced (same call)."""
    return any(step_of.get(src) == step.id for src in n.input_nodes) or all(
        src.startswith(("param:", "buffer:", "const:")) for src in n.input_nodes
    )


def _ref(src: str, step_of: dict[str, int]) -> str | None:
    if src.startswith(("param:", "buffer:", "const:")):
        return None
    if src in step_of:
        return str(step_of[src])
    return f"block_input:{src}"


def dataflow_frame(steps: list[FlowStep]) -> pd.DataFrame:
    """The steps of :func:`block_dataflow` as a DataFrame (one row per step)."""
    return pd.DataFrame([s.__dict__ for s in steps])


def specs_from_graph(graph) -> list[OpSpec]:
    """OpSpecs (forward) from an autoplan.capture ModelGraph's ``distinct_ops()``, block counts included.

    The IR encodes a tensor argument as ``{"tensor": i}`` (an index into the op's input metas) and
    dtypes, devices and enums as one-key dicts; they become TensorSpecs, dtype strings and the
    replay-device marker here.
    """
    specs = []
    for d in distinct_ops(graph):
        metas = [TensorSpec(tuple(m.shape), m.dtype if m.dtype.startswith("torch.") else f"torch.{m.dtype}",
                            tuple(m.stride) if m.stride is not None and len(m.stride) == len(m.shape) else None)
                 for m in d.inputs]

        def conv(v, metas=metas, name=d.op):
            if isinstance(v, dict):
                if set(v) == {"tensor"}:
                    try:
                        return metas[v["tensor"]]
                    except IndexError as exc:
                        raise CostModelError(f"specs_from_graph: op {name!r} refers to missing input {v}") from exc
                if set(v) == {"device"}:
                    return REPLAY_DEVICE
                if set(v) == {"dtype"}:
                    return "torch." + str(v["dtype"]).split(".")[-1]
                if "enum" in v:
                    return "torch." + str(v["enum"]).split(".")[-1]
                raise CostModelError(f"specs_from_graph: op {name!r} has an argument the profiler cannot read: {v}")
            if isinstance(v, list):
                return ("__list__",) + tuple(conv(y) for y in v)
            if isinstance(v, tuple):
                return tuple(conv(y) for y in v)
            return v

        op = d.op if d.op.count(".") == 2 else f"{d.op}.default"
        specs.append(OpSpec(op=op, args=tuple(conv(a) for a in d.args),
                            kwargs=tuple(sorted((k, conv(v)) for k, v in d.kwargs.items())), count=d.count))
    return dedupe(specs)
