"""FLOPs, bytes and saved-for-backward tensors of one ATen op, measured by running it on meta.

Each distinct (op, shapes, dtypes, args) is run once on empty meta tensors under
``FlopCounterMode`` (forward), then differentiated under a second one (backward), with
``saved_tensors_hooks`` recording what autograd keeps. So the IR counts exactly what torch's own
counter counts, op by op, and CompositeImplicit ops (linear, matmul) decompose as they would.

Attention: on CPU ``F.scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``,
which FlopCounterMode counts as 0. :func:`register_flop_formulas` gives it (and its backward)
torch's own SDPA formulas (4·b·h·s_q·s_kv·d forward, causal masks not discounted; backward 2.5x,
scores recomputed as fused kernels do). On meta SDPA takes the math path (backward 2x, the
(b, h, s, s) probabilities kept), so :func:`measure` counts an SDPA node as a fused kernel:
those same formulas, and q, k, v, output and log-sum-exp kept for backward. MoE grouped GEMMs, also 0 for the
counter, get 2·M·K·N (backward twice that) registered the same way.

What an op without FLOPs moves is read off the kernels it dispatches to below autograd (:func:`moved_bytes`),
not off its name or its schema alone: ``aten.to.dtype`` is annotated as an alias, yet a cast to another
dtype runs ``_to_copy``, which reads the tensor and writes the converted copy (RMSNorm's and rotary's
``x.float()``); ``type_as`` reads only ``self`` (``other`` lends its dtype); a cast to the dtype it already
has dispatches nothing and moves nothing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import flop_counter
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)
aten = torch.ops.aten

_registered: set[str] = set()


def _grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2·M·K·N for tokens (M, K) times per-expert weights (E, K, N); batched 3-D x 3-D too."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # (K, M) x (M, N) split along M: per-group weight grads
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 0


def _grouped_mm_bwd_flop(a_shape, b_shape, offs_shape, grad_shape, *args, out_shape=None, **kwargs) -> int:
    """grad input plus grad weight: twice the forward."""
    return 2 * _grouped_mm_flop(a_shape, b_shape)


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_bwd_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _register(name: str, packet: Any, formula: Callable) -> None:
    if name in _registered or packet is None:
        return
    if packet not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(packet)(formula)
    _registered.add(name)


def register_flop_formulas() -> None:
    """Give torch's FlopCounterMode formulas for kernels it counts as 0. Idempotent.

    - the CPU flash-attention kernel and its backward: torch's own SDPA formulas;
    - grouped GEMMs of MoE experts (``aten._grouped_mm``, transformers' ``grouped_mm_fallback``
      custom op and its backward op): 2·M·K·N forward, twice that backward.
    transformers' ops exist only once it has been imported; calling again later adds them.
    """
    _register("sdpa_cpu", getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None), _sdpa_cpu_flop)
    cpu_bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    _register("sdpa_cpu_bwd", cpu_bwd, _sdpa_cpu_bwd_flop)
    _register("grouped_mm", getattr(aten, "_grouped_mm", None), _grouped_mm_flop)
    try:  # the repo MoE model's grouped expert GEMM (autoplan.models.moe), weights [E, out, in]
        ns = torch.ops.autoplan
        _register("autoplan_expert_mm", ns.expert_mm, lambda a, b, *r, out_shape=None, **k: 2 * a[0] * a[1] * b[1])
        _register("autoplan_expert_mm_wgrad", ns.expert_mm_wgrad,
                  lambda g, x, *r, out_shape=None, **k: 2 * g[0] * g[1] * x[1])
    except (AttributeError, RuntimeError):
        pass
    try:
        ns = torch.ops.transformers
        fwd, bwd = ns.grouped_mm_fallback, ns.grouped_mm_fallback_backward
    except (AttributeError, RuntimeError):
        return
    _register("hf_grouped_mm", fwd, _grouped_mm_flop)
    _register("hf_grouped_mm_bwd", bwd, _grouped_mm_bwd_flop)


@dataclass
class OpCost:
    flops_fwd: int = 0
    flops_bwd: int = 0
    saved_inputs: list[int] = field(default_factory=list)  # argument tensor positions kept
    saved_output: bool = False
    saved_internal_bytes: int = 0
    output_requires_grad: bool = False
    # (bytes read, bytes written) forward, from the kernels the op ran (moved_bytes); None where
    # they are not read that way (ops with FLOPs, ops that did not run): all inputs and outputs
    moved: tuple[int, int] | None = None
    # positions (flattened tensor order) of inputs whose data the op never reads (``type_as``'s
    # ``other``, which lends only its dtype): a fused chain does not read them either
    unread: list[int] = field(default_factory=list)


def is_view(op: Any) -> bool:
    """True when the op's schema says its result aliases its input (view, reshape, transpose; also
    ``to``, which returns its input only when nothing changes: see :func:`moved_bytes`)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


class _Kernels(TorchDispatchMode):
    """The kernels one op runs below autograd: a CompositeImplicit op (``to``, ``type_as``,
    ``reshape``) as what it decomposes into; an op that returns its input runs none."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.calls.append((func, _flatten(list(args)) + _flatten(list(kwargs.values())), _flatten(out)))
        return out


def _storage(t: torch.Tensor):
    return StorageWeakRef(t.untyped_storage())


def _aliasing_kernel(func: Any, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> bool:
    """A kernel that moves no data: its schema returns an alias it does not write (``view``,
    ``expand``), or each output shares an input's storage without an in-place write
    (``_unsafe_view``, whose schema carries no annotation)."""
    if is_view(func):
        return True
    schema = getattr(func, "_schema", None)
    if schema is not None and any(r.alias_info is not None and r.alias_info.is_write for r in schema.returns):
        return False
    held = {_storage(t) for t in ins}
    return bool(outs) and all(_storage(o) in held for o in outs)


def moved_bytes(op: Any, tensors: list[torch.Tensor], outs: list[torch.Tensor],
                calls: list) -> tuple[int, int, list[int]]:
    """(bytes read, bytes written, positions of the inputs it does not read) of one FLOP-free op,
    from the kernels it ran (``calls``, as :class:`_Kernels` records them): each input whose storage
    a data-moving kernel reads, each output whose storage one writes. An op whose schema says it aliases and whose result keeps its
    input's dtype moves nothing even where it ran a copy on meta (a ``reshape`` of a transposed
    attention output): the layout a fused attention kernel writes on a device (q's) makes that a
    view, while the capture's layouts are the meta kernels'. A dtype conversion is always a copy."""
    if is_view(op) and {o.dtype for o in outs} <= {t.dtype for t in tensors}:
        return 0, 0, []
    moving = [(ins, o) for f, ins, o in calls if not _aliasing_kernel(f, ins, o)]
    read = {_storage(t) for ins, _ in moving for t in ins}
    written = {_storage(t) for _, o in moving for t in o}
    seen: set[int] = set()
    nread = 0
    for t in tensors:
        if id(t) not in seen and _storage(t) in read:
            seen.add(id(t))
            nread += t.numel() * t.element_size()
    nwritten = sum(o.numel() * o.element_size() for o in outs if _storage(o) in written)
    unread = [i for i, t in enumerate(tensors) if _storage(t) not in read] if nread or nwritten else []
    return nread, nwritten, unread


def _flatten(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for o in x for t in _flatten(o)]
    return []


def _with_grad(args: list[Any], kwargs: dict[str, Any], grad_args: set[int]) -> tuple[list[Any], dict[str, Any]]:
    """Fresh meta tensors; those at ``grad_args`` are non-leaf tensors that require grad (so an
    in-place op on them is legal, as it is on activations in the real graph)."""
    counter = iter(range(1 << 30))

    def fresh(x):
        if isinstance(x, torch.Tensor):
            i = next(counter)
            t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
            if i in grad_args and t.is_floating_point():
                t = t.requires_grad_(True).clone()
            return t
        if isinstance(x, (list, tuple)):
            return type(x)(fresh(v) for v in x)
        return x

    new_args = fresh(list(args))
    return new_args, {k: fresh(v) for k, v in kwargs.items()}


def measure(op: Callable, args: list[Any], kwargs: dict[str, Any], grad_args: set[int], param_args: set[int]) -> OpCost:
    """Run ``op`` once on the meta tensors in ``args``; tensors at positions ``grad_args``
    (in flattened-tensor order) require grad, those at ``param_args`` are parameters."""
    cost = OpCost()
    args, kwargs = _with_grad(args, kwargs, grad_args)
    tensors = _flatten(args) + _flatten(list(kwargs.values()))
    saved: list[torch.Tensor] = []
    kernels = _Kernels()
    try:
        with FlopCounterMode(display=False) as fwd, kernels:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = op(*args, **kwargs)
    except Exception as exc:  # an op autograd rejects on these inputs: measure forward only
        log.debug("op %s with grad failed (%s); measuring forward only", op, exc)
        args, kwargs = _with_grad(args, kwargs, set())
        tensors = _flatten(args) + _flatten(list(kwargs.values()))
        saved.clear()
        kernels = _Kernels()
        with FlopCounterMode(display=False) as fwd, kernels:
            out = op(*args, **kwargs)
    cost.flops_fwd = fwd.get_total_flops()
    outs = _flatten(out)
    if cost.flops_fwd == 0:
        nread, nwritten, cost.unread = moved_bytes(op, tensors, outs, kernels.calls)
        cost.moved = (nread, nwritten)
    fused_sdpa = False
    if op is aten.scaled_dot_product_attention.default and len(tensors) >= 3:
        # meta runs the math path (two bmm, backward four); fused kernels recompute scores in
        # backward, so count what flash/efficient/cudnn (and torch's formulas for them) count
        q, k, v = (tuple(t.shape) for t in tensors[:3])
        if len(q) == len(k) == len(v) == 4:
            fused_sdpa = any(t.requires_grad for t in tensors[:3])
            cost.flops_fwd = flop_counter.sdpa_flop_count(q, k, v)
            if fused_sdpa:
                cost.flops_bwd = flop_counter.sdpa_backward_flop_count(q[:3] + (v[3],), q, k, v)
    diff_outs = [o for o in outs if o.requires_grad and o.grad_fn is not None]
    cost.output_requires_grad = bool(diff_outs)
    grad_inputs = [t for t in tensors if t.requires_grad]
    if diff_outs and grad_inputs and cost.flops_bwd == 0:
        try:
            with FlopCounterMode(display=False) as bwd:
                torch.autograd.grad(
                    diff_outs, grad_inputs, [torch.empty_like(o) for o in diff_outs], allow_unused=True
                )
            cost.flops_bwd = bwd.get_total_flops()
        except Exception as exc:
            log.debug("backward of %s not measurable on meta: %s", op, exc)
    if fused_sdpa:
        # what a fused kernel keeps: q, k, v (and a mask), its output and the fp32 log-sum-exp --
        # not the math path's (b, h, s, s) probabilities
        cost.saved_inputs = [i for i in range(len(tensors)) if i not in param_args]
        cost.saved_output = True
        q = tensors[0].shape
        cost.saved_internal_bytes = q[0] * q[1] * q[2] * 4
        return cost
    for s in saved:
        base = s._base if s._base is not None else s
        hit = next((i for i, t in enumerate(tensors) if s is t or base is t), None)
        if hit is not None:
            if hit not in param_args and hit not in cost.saved_inputs:
                cost.saved_inputs.append(hit)
        elif any(s is o or base is o for o in outs):
            cost.saved_output = True
        else:
            cost.saved_internal_bytes += s.numel() * s.element_size()
    return cost
