"""torch.export (non-strict, meta tensors) -> ModelGraph nodes and edges.

Every call_function node of the exported program becomes a Node: its owner comes from
``meta["nn_module_stack"]``, shapes from ``meta["val"]``, parameters from the graph signature,
costs from :func:`autoplan.capture.opcost.measure` (once per distinct op and shape).
"""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autoplan.capture.blocks import block_of, remap_fqn, type_name
from autoplan.capture.ir import BlockGroup, Edge, Node, TensorMeta
from autoplan.capture.opcost import is_view, measure
from autoplan.capture.quiet import quiet_torch

log = logging.getLogger(__name__)

# Measured op costs, process-wide: a key is pure data (op name, JSON args, input metas, which
# inputs need grad, which are parameters), so a cost measured for one capture holds for every
# other; plan_cluster captures a model at several shapes and notebooks re-plan the same model.
_MEASURED: dict[Any, Any] = {}
_MEASURED_MAX = 50_000

_SKIP = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default"}


def export(model: nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """Non-strict export; dynamic shapes are off so every size is a plain int. Nodes carry no stack
    traces: nothing here reads them, and symbolising one per node was a tenth of the capture. A
    failed export's partial graph and logs go to the debug log (capture tries several ways and says
    what failed in its own terms)."""
    before = fx.config.do_not_emit_stack_traces
    fx.config.do_not_emit_stack_traces = True
    try:
        with quiet_torch(prints=True):
            return torch.export.export(model, args, kwargs, strict=False)
    finally:
        fx.config.do_not_emit_stack_traces = before


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(int(s) for s in t.shape), str(t.dtype), tuple(int(s) for s in t.stride()))


def _metas(val: Any) -> list[TensorMeta]:
    if isinstance(val, torch.Tensor):
        return [tensor_meta(val)]
    if isinstance(val, (list, tuple)):
        return [m for v in val for m in _metas(v)]
    return []


def _jsonable(value: Any) -> Any:
    """A non-tensor argument as a JSON value (dtype, device, enums become tagged strings)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": str(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {"enum": str(value)}
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {"sym": str(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return {"repr": repr(value)}


class _ArgWalker:
    """Turns fx args into (JSON args, tensor metas, producer names, meta tensors for measuring)."""

    def __init__(self, producer_of: dict[str, str]):
        self.producer_of = producer_of
        self.metas: list[TensorMeta] = []
        self.producers: list[str] = []
        self.live: list[torch.Tensor] = []

    def walk(self, a: Any) -> tuple[Any, Any]:
        if isinstance(a, fx.Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                i = len(self.metas)
                self.metas.append(tensor_meta(val))
                self.producers.append(self.producer_of.get(a.name, a.name))
                t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
                self.live.append(t)
                return {"tensor": i}, t
            return _jsonable(val), val
        if isinstance(a, (list, tuple)):
            pairs = [self.walk(x) for x in a]
            return [p[0] for p in pairs], type(a)(p[1] for p in pairs)
        if isinstance(a, dict):
            pairs = {k: self.walk(v) for k, v in a.items()}
            return {k: p[0] for k, p in pairs.items()}, {k: p[1] for k, p in pairs.items()}
        if isinstance(a, torch.device):  # measured on meta: an op that creates tensors allocates nothing
            return _jsonable(a), torch.device("meta")
        return _jsonable(a), a


def _owner(node: fx.Node, rename: dict[str, str], root_type: str) -> tuple[str, str, list[str]]:
    stack = node.meta.get("nn_module_stack") or {}
    scope, owner, otype = [], "", root_type
    for path, mtype in stack.values():
        fqn = remap_fqn(path, rename) if path else ""
        scope.append(fqn)
        owner = fqn
        otype = mtype if isinstance(mtype, str) else _class_name(mtype)
    return owner, otype, scope


def _class_name(cls: Any) -> str:
    if isinstance(cls, nn.Module):
        return type_name(cls)
    return f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', str(cls))}"


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    return str(target)


def _non_member(scope: list[str], non_reps: set[str]) -> bool:
    return any(s in non_reps for s in scope)


@dataclass
class SubExport:
    """Where an exported submodule sits in the whole model (hook fallback, see fallback.py):
    its FQN, the scope above it, and for each of its tensor inputs (in order) the producer in
    the outer graph and whether it requires grad."""

    prefix: str
    outer_scope: list[str]
    input_producers: list[str]
    input_grads: list[bool]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else (prefix or name)


def to_nodes(
    ep: torch.export.ExportedProgram,
    rename: dict[str, str],
    groups: list[BlockGroup],
    root_type: str,
    sub: SubExport | None = None,
) -> tuple[list[Node], list[Edge], list[dict], list[dict]]:
    """Nodes, edges, graph inputs and outputs of an exported program (non-representative block
    members, when present because shortening was not possible, are dropped). With ``sub`` the
    program is one submodule: names are made global and inputs linked to outer producers."""
    non_reps = {m for g in groups for m in g.member_fqns() if m != g.representative}
    prefix = sub.prefix if sub else ""
    producer_of: dict[str, str] = {}
    requires_grad: dict[str, bool] = {}
    graph_inputs: list[dict] = []
    user_inputs = 0
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        kind = spec.kind.name
        if kind == "PARAMETER":
            # a shortened block's parameters are named by their real FQN, as its modules are
            producer_of[name] = f"param:{remap_fqn(_join(prefix, spec.target), rename)}"
            requires_grad[producer_of[name]] = True
        elif kind == "BUFFER":
            producer_of[name] = f"buffer:{remap_fqn(_join(prefix, spec.target), rename)}"
        elif kind in ("CONSTANT_TENSOR", "CUSTOM_OBJ", "TOKEN"):
            producer_of[name] = f"const:{_join(prefix, spec.target or name)}"
        elif sub is not None and isinstance(getattr(spec.arg, "name", None), str) and _is_tensor_placeholder(ep, name):
            i = user_inputs
            user_inputs += 1
            producer_of[name] = sub.input_producers[i] if i < len(sub.input_producers) else f"input:{name}"
            requires_grad[producer_of[name]] = i < len(sub.input_grads) and sub.input_grads[i]
        else:
            producer_of[name] = f"input:{name}"
    for node in ep.graph.nodes:
        if node.op == "placeholder" and producer_of.get(node.name, "").startswith("input:"):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                graph_inputs.append({"name": node.name, **_tm_dict(tensor_meta(val))})

    # A block's representative is costed as a middle member: activations that enter it and
    # derive from the user's inputs require grad there even when, for the first member, they
    # do not (a model whose first layer reads the raw float input).
    from_input: dict[str, bool] = {p: True for p in producer_of.values() if p.startswith("input:")}
    block_at: dict[str, str | None] = {}
    nodes: list[Node] = []
    by_name: dict[str, Node] = {}
    cache = _MEASURED
    if len(cache) > _MEASURED_MAX:
        cache.clear()
    for fxn in ep.graph.nodes:
        if fxn.op != "call_function":
            continue
        op = _op_name(fxn.target)
        if op in _SKIP:
            continue
        owner, otype, scope = _owner(fxn, rename, root_type)
        if sub is not None:
            owner = _join(prefix, owner)
            scope = sub.outer_scope + [_join(prefix, x) for x in scope if x] if scope else sub.outer_scope + [prefix]
        if _non_member(scope, non_reps):
            continue
        node_name = f"{prefix}:{fxn.name}" if sub is not None else fxn.name
        producer_of[fxn.name] = node_name
        walker = _ArgWalker(producer_of)
        jargs, margs = walker.walk(list(fxn.args))
        jkwargs, mkwargs = walker.walk(dict(fxn.kwargs))
        outputs = _metas(fxn.meta.get("val"))
        block_id = block_of(owner, groups)
        grad_mask = {
            i
            for i, p in enumerate(walker.producers)
            if requires_grad.get(p, False) or _enters_block(p, block_id, from_input, block_at, walker.metas[i])
        }
        param_idx = {i for i, p in enumerate(walker.producers) if not _is_activation(p)}
        node = Node(
            name=node_name,
            op=op,
            module=owner,
            module_type=otype,
            scope=scope,
            args=jargs,
            kwargs=jkwargs,
            inputs=walker.metas,
            input_nodes=walker.producers,
            outputs=outputs,
            params=sorted({p[6:] for p in walker.producers if p.startswith("param:")}),
            buffers=sorted({p[7:] for p in walker.producers if p.startswith("buffer:")}),
            block=block_id,
        )
        if op == "getitem":  # one output of a multi-output op: link it to that op
            src = producer_of.get(fxn.args[0].name) if isinstance(fxn.args[0], fx.Node) else None
            if src is not None and not walker.producers:
                node.input_nodes, node.inputs = [src], list(outputs[:1])
            node.requires_grad = bool(src and requires_grad.get(src, False))
        elif outputs or walker.metas:
            key = (op, repr(jargs), repr(jkwargs), tuple(walker.metas), tuple(sorted(grad_mask)), tuple(sorted(param_idx)))
            cost = cache.get(key)
            if cost is None:
                try:
                    cost = measure(fxn.target, margs, mkwargs, grad_mask, param_idx)
                except Exception as exc:
                    log.debug("could not run %s on meta (%s); costs left at 0", op, exc)
                    cost = None
                cache[key] = cost
            if cost is not None:
                node.flops_fwd, node.flops_bwd = cost.flops_fwd, cost.flops_bwd
                node.requires_grad = cost.output_requires_grad
                node.saved_internal_bytes = cost.saved_internal_bytes
                node.saves = sorted({walker.producers[i] for i in cost.saved_inputs if i < len(walker.producers)})
                if cost.saved_output:
                    node.saves.append(node.name)
                    node.saved_for_backward = True
            if cost is not None and cost.moved is not None:   # what the kernels it ran move (opcost)
                node.bytes_read, node.bytes_written = cost.moved
                node.unread = list(cost.unread)
            elif not is_view(fxn.target):
                node.bytes_read = sum(m.nbytes for m in walker.metas)
                node.bytes_written = sum(m.nbytes for m in outputs)
        if is_view(fxn.target) and walker.producers and not any(_is_activation(p) for p in walker.producers):
            # a view of a parameter (a transposed expert weight fed to a grouped GEMM) is that
            # parameter to its users: what they save of it is no activation
            producer_of[fxn.name] = walker.producers[0]
        requires_grad[node.name] = node.requires_grad
        block_at[node.name] = node.block
        from_input[node.name] = any(from_input.get(p) for p in node.input_nodes)
        nodes.append(node)
        by_name[node.name] = node
    for node in nodes:
        for src in node.saves:
            if src in by_name:
                by_name[src].saved_for_backward = True
    edges = [
        Edge(src, n.name, m.shape, m.dtype, m.nbytes)
        for n in nodes
        for src, m in zip(n.input_nodes, n.inputs)
        if _is_activation(src) and (src in by_name or src.startswith("input:"))
    ]
    outputs = []
    for fxn in ep.graph.nodes:
        if fxn.op == "output":
            for a in fxn.args[0] if isinstance(fxn.args[0], (list, tuple)) else [fxn.args[0]]:
                if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
                    outputs.append({"name": producer_of.get(a.name, a.name), **_tm_dict(tensor_meta(a.meta["val"]))})
    return nodes, edges, graph_inputs, outputs


def _enters_block(producer: str, block_id: str | None, from_input: dict, block_at: dict, meta: TensorMeta) -> bool:
    """A float activation from the user's inputs crossing into a block (see to_nodes)."""
    return (
        block_id is not None
        and bool(from_input.get(producer))
        and block_at.get(producer) != block_id
        and meta.dtype in ("torch.float32", "torch.float16", "torch.bfloat16", "torch.float64")
    )


def _is_tensor_placeholder(ep: torch.export.ExportedProgram, name: str) -> bool:
    for n in ep.graph.nodes:
        if n.op == "placeholder" and n.name == name:
            return isinstance(n.meta.get("val"), torch.Tensor)
    return False


def _is_activation(producer: str) -> bool:
    return not producer.startswith(("param:", "buffer:", "const:"))


def _tm_dict(m: TensorMeta) -> dict:
    return {"shape": list(m.shape), "dtype": m.dtype}
