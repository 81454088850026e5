"""Capture with forward hooks, for models torch.export cannot trace as a whole.

The model runs eagerly on meta with a hook on every module. A dispatch mode answers the reads of
tensor values that meta cannot answer (``.item()``, ``bool(t)``, ``nonzero``) with
zero/False/empty, so data-dependent control flow takes one branch instead of failing, and records
the module where that happened; a split by sizes read that way (routing by token counts) gives
each part an even share.  Then, top-down, every module call that read no such value is
exported on its own with the inputs it was called with: those parts come out op by op, as from a
whole-model export. What is left -- the modules that read values, minus their exportable
children -- becomes one node per call, named in a warning. For those nodes FLOPs come from
torch's formulas applied op by op and credited to the innermost running module; backward is taken
as twice forward (grad input + grad weight), and a module with weights as keeping its input.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from autoplan.capture.blocks import block_of, type_name
from autoplan.capture.fake import is_fake
from autoplan.capture.ir import BlockGroup, Edge, ModelGraph, ModuleInfo, Node
from autoplan.capture.trace import SubExport, export, tensor_meta, to_nodes
from autoplan.errors import CaptureError

log = logging.getLogger(__name__)
aten = torch.ops.aten


class _MetaEager(TorchDispatchMode):
    """Counts FLOPs per innermost module and invents values meta tensors cannot give."""

    def __init__(self, stack: list[str], open_calls: list[dict[str, Any]]):
        super().__init__()
        self.stack = stack
        self.open_calls = open_calls
        self.flops: dict[int, int] = {}  # call index -> FLOPs of its own ops
        self.data_dependent: dict[str, int] = {}

    def _note(self, what: str) -> None:
        where = self.stack[-1] if self.stack else ""
        self.data_dependent[where] = self.data_dependent.get(where, 0) + 1
        log.debug("%s on meta in module %r answered with a placeholder", what, where)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        on_meta = any(isinstance(t, torch.Tensor) and (t.device.type == "meta" or is_fake(t)) for t in flat)
        if on_meta and func in (aten._local_scalar_dense.default, aten.item.default):
            self._note("reading a value")
            t = args[0]
            return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
        if on_meta and func is aten.is_nonzero.default:
            self._note("bool()")
            return False
        if on_meta and func in (aten.nonzero.default,):
            self._note("nonzero")
            return torch.empty((0, args[0].dim()), dtype=torch.long, device=args[0].device)
        if on_meta and func in _SPLITS and self.data_dependent:
            args = even_split(func, args, kwargs, self._note)
        if on_meta and func is getattr(aten._grouped_mm, "default", None):
            out = _grouped_mm_shape(*args, **kwargs)  # the meta kernel insists on bf16
        else:
            out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            where = self.open_calls[-1]["index"] if self.open_calls else -1
            try:
                self.flops[where] = self.flops.get(where, 0) + int(formula(*args, **kwargs, out_val=out))
            except Exception as exc:  # a formula that cannot read these args: count nothing
                log.debug("no FLOPs for %s: %s", func, exc)
        return out


_SPLITS = (aten.split_with_sizes.default, aten.split_with_sizes_copy.default)


def even_split(func, args: tuple, kwargs: dict, note) -> tuple:
    """The sizes of a split that cannot hold (they do not add up to the dimension split) once values
    were answered with placeholders: routing by token counts read as zeros (JetMoE's
    ``x.split(expert_size.tolist())``). Each part gets an even share of the dimension instead, as a
    balanced router gives it, so the experts after it run on a count of rows that sums right."""
    t, sizes = args[0], list(args[1])
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    total = t.shape[dim]
    if sum(sizes) == total or not sizes:
        return args
    note("split by data-dependent sizes")
    share, extra = divmod(total, len(sizes))
    even = [share + (1 if i < extra else 0) for i in range(len(sizes))]
    return (t, even, *args[2:])


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, *rest, **kw):
    """Empty result of ``torch._grouped_mm`` (2-D x 3-D, 3-D x 3-D, or 2-D x 2-D split by ``offs``)."""
    dtype = kw.get("out_dtype") or a.dtype
    if a.dim() == 2 and b.dim() == 3:
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    elif a.dim() == 2 and b.dim() == 2 and offs is not None:
        shape = (offs.shape[0], a.shape[0], b.shape[-1])
    else:
        shape = (a.shape[0], b.shape[-1])
    return torch.empty(shape, dtype=dtype, device=a.device)


def _tensors(x: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(x)
    return [t for t in flat if isinstance(t, torch.Tensor)]


def _ordered_tensors(mod: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """Tensor inputs in the order export numbers them: arguments bound to the forward signature."""
    try:
        bound = inspect.signature(mod.forward).bind(*args, **kwargs)
        return _tensors(list(bound.arguments.values()))
    except (TypeError, ValueError):
        return _tensors((args, kwargs))


def _inside(call: dict, exported: set[int], calls: list[dict]) -> bool:
    parent = call["parent"]
    while parent is not None:
        if parent in exported:
            return True
        parent = calls[parent]["parent"]
    return False


def _export_call(mm: nn.Module, call: dict, in_nodes: list[str], groups: list[BlockGroup], params: dict):
    """Op-level nodes of one module call exported on its own, or None when export fails."""
    try:
        ep = export(call["module"], tuple(call["args"]), dict(call["kwargs"]))
    except Exception as exc:
        log.debug("export of %r alone failed: %s", call["fqn"], exc)
        return None
    acts = [p for p in in_nodes if not p.startswith("param:")]
    sub = SubExport(
        prefix=call["fqn"],
        outer_scope=[s for s in call["scope"][:-1] if s],
        input_producers=acts,
        input_grads=[not p.startswith("input:") for p in acts],
    )
    nodes, _, _, outputs = to_nodes(ep, {}, groups, call["type"], sub)
    return nodes, [o["name"] for o in outputs]


def capture_with_hooks(
    mm: nn.Module,
    args: tuple,
    kwargs: dict,
    infos: dict[str, ModuleInfo],
    groups: list[BlockGroup],
    tied: list[list[str]],
    nparams: int,
    errors: list[str],
) -> ModelGraph:
    """One Node per module call (ops of its own, children excluded); see module docstring."""
    stack: list[str] = []
    calls: list[dict[str, Any]] = []
    open_calls: list[dict[str, Any]] = []
    producer: dict[int, str] = {}
    keep_alive: list[torch.Tensor] = []
    names = {m: fqn for fqn, m in mm.named_modules()}
    params = {id(p): fqn for fqn, p in mm.named_parameters()}

    def pre(mod, a, kw):
        fqn = names.get(mod, "")
        stack.append(fqn)
        call = {
            "fqn": fqn, "type": type_name(mod), "scope": list(stack), "index": len(calls),
            "parent": open_calls[-1]["index"] if open_calls else None, "module": mod,
            "args": a, "kwargs": kw, "inputs": _ordered_tensors(mod, a, kw),
        }
        calls.append(call)
        open_calls.append(call)

    def post(mod, a, kw, out):
        call = open_calls.pop()
        stack.pop()
        call["outputs"] = _tensors(out)

    handles = []
    for mod in mm.modules():
        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    mode = _MetaEager(stack, open_calls)
    try:
        with mode, torch.no_grad():
            mm(*args, **kwargs)
    except Exception as exc:
        where = stack[-1] if stack else type(mm).__name__
        raise CaptureError(f"{type(mm).__name__} does not run on meta (failed in module {where!r}): {exc}") from exc
    finally:
        for h in handles:
            h.remove()

    flat_inputs = _tensors((args, kwargs))
    for i, t in enumerate(flat_inputs):
        producer[id(t)] = f"input:arg{i}"
    non_reps = {m for g in groups for m in g.member_fqns() if m != g.representative}
    dirty = set(mode.data_dependent)
    nodes: list[Node] = []
    exported: set[int] = set()
    for call in calls:
        if "outputs" not in call or any(s in non_reps for s in call["scope"]):
            continue
        if _inside(call, exported, calls):
            continue
        fqn = call["fqn"]
        ins, outs = call["inputs"], call["outputs"]
        in_nodes = [f"param:{params[id(t)]}" if id(t) in params else producer.get(id(t), "const:untracked") for t in ins]
        if call["index"] > 0 and not any(d == fqn or d.startswith(fqn + ".") for d in dirty):
            sub_nodes = _export_call(mm, call, in_nodes, groups, params)
            if sub_nodes is not None:
                op_nodes, out_names = sub_nodes
                nodes.extend(op_nodes)
                for t, name in zip(outs, out_names):
                    producer[id(t)] = name
                    keep_alive.append(t)
                exported.add(call["index"])
                continue
        name = f"call{call['index']}:{fqn or 'root'}"
        for t in outs:
            producer.setdefault(id(t), name)
            keep_alive.append(t)
        own_params = [f"{fqn}.{p}" if fqn else p for p in infos[fqn].params] if fqn in infos else []
        fwd = mode.flops.get(call["index"], 0)
        param_bytes = sum(p.numel() * p.element_size() for p in mm.get_submodule(fqn).parameters(recurse=False))
        act_in = sum(t.numel() * t.element_size() for t in ins if id(t) not in params)
        nodes.append(
            Node(
                name=name,
                op=f"module:{call['type']}",
                module=fqn,
                module_type=call["type"],
                scope=[s for s in call["scope"] if s],
                args=[{"tensor": i} for i in range(len(ins))],
                kwargs={},
                inputs=[tensor_meta(t) for t in ins],
                input_nodes=in_nodes,
                outputs=[tensor_meta(t) for t in outs],
                flops_fwd=fwd,
                flops_bwd=2 * fwd,
                bytes_read=act_in + param_bytes,
                bytes_written=sum(t.numel() * t.element_size() for t in outs),
                params=own_params,
                requires_grad=True,
                saved_internal_bytes=act_in if own_params else 0,
                block=block_of(fqn, groups),
            )
        )
    untraceable = sorted(mode.data_dependent) or ["<root>"]
    msg = (
        f"export could not trace {type(mm).__name__}; the modules that read data-dependent values "
        f"({', '.join(repr(u) for u in untraceable)}) are captured at module level with forward hooks "
        "(values answered with zeros, FLOPs of branches not taken are missing); the rest op by op"
    )
    log.warning("%s", msg)
    names_set = {n.name for n in nodes}
    edges = [
        Edge(src, n.name, m.shape, m.dtype, m.nbytes)
        for n in nodes
        for src, m in zip(n.input_nodes, n.inputs)
        if src in names_set
    ]
    inputs = [{"name": f"arg{i}", "shape": list(t.shape), "dtype": str(t.dtype)} for i, t in enumerate(flat_inputs)]
    root_out = next((c for c in calls if c["fqn"] == "" and "outputs" in c), None)
    outputs = [
        {"name": producer.get(id(t), "?"), "shape": list(t.shape), "dtype": str(t.dtype)}
        for t in (root_out or {}).get("outputs", [])
    ]
    return ModelGraph(
        model_type=type_name(mm),
        nodes=nodes,
        edges=edges,
        modules=infos,
        blocks=groups,
        tied_parameters=tied,
        inputs=inputs,
        outputs=outputs,
        method="hooks",
        warnings=errors + [msg],
        num_parameters=nparams,
    )
