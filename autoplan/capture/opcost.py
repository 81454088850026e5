"""FLOPs, bytes and saved-for-backward tensors of one ATen op, measured by running it on meta.

Each distinct (op, shapes, dtypes, args) is run once on empty meta tensors under
``FlopCounterMode`` (forward), then differentiated under a second one (backward), with
``saved_tensors_hooks`` recording what autograd keeps. So the IR counts exactly what torch's own
counter counts, op by op, and CompositeImplicit ops (linear, matmul) decompose as they would.

Attention: on CPU ``F.scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention_for_cpu``,
which FlopCounterMode counts as 0. :func:`register_attention_flops` gives it (and its backward)
torch's own SDPA formulas (4·b·h·s_q·s_kv·d forward, causal masks not discounted), the same
numbers the math path on meta yields through its two bmm's. Custom grouped GEMMs (MoE experts)
get 2·M·K·N.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

log = logging.getLogger(__name__)
aten = torch.ops.aten

_registered = False


def register_attention_flops() -> None:
    """Give the CPU flash-attention kernel (forward, backward) torch's SDPA FLOP formulas. Idempotent."""
    global _registered
    if _registered:
        return
    registry = flop_counter.flop_registry
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in registry:

        def cpu_sdpa_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

        flop_counter.register_flop_formula(fwd)(cpu_sdpa_flop)
    if bwd is not None and bwd not in registry:

        def cpu_sdpa_bwd_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

        flop_counter.register_flop_formula(bwd)(cpu_sdpa_bwd_flop)
    _registered = True


def _grouped_mm_flops(args: list[Any]) -> int:
    """2·M·K·N for x (M, K) times per-group weights (G, K, N)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if len(tensors) < 2 or tensors[0].dim() != 2 or tensors[1].dim() != 3:
        return 0
    m, k = tensors[0].shape
    n = tensors[1].shape[-1] if tensors[1].shape[-2] == k else tensors[1].shape[-2]
    return 2 * m * k * n


# Ops torch's counter does not know, by name fragment: forward formula; backward is 2x forward.
EXTRA_FORMULAS: dict[str, Callable[[list[Any]], int]] = {"grouped_mm": _grouped_mm_flops}


@dataclass
class OpCost:
    flops_fwd: int = 0
    flops_bwd: int = 0
    saved_inputs: list[int] = field(default_factory=list)  # argument tensor positions kept
    saved_output: bool = False
    saved_internal_bytes: int = 0
    output_requires_grad: bool = False


def is_view(op: Any) -> bool:
    """True when the op's result aliases its input (view, reshape-as-view, transpose, getitem)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _flatten(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for o in x for t in _flatten(o)]
    return []


def measure(op: Callable, args: list[Any], kwargs: dict[str, Any], grad_args: set[int], param_args: set[int]) -> OpCost:
    """Run ``op`` once on the meta tensors in ``args``; tensors at positions ``grad_args``
    (in flattened-tensor order) require grad, those at ``param_args`` are parameters."""
    cost = OpCost()
    tensors = _flatten(args) + _flatten(list(kwargs.values()))
    for i, t in enumerate(tensors):
        if i in grad_args and t.is_floating_point():
            t.requires_grad_(True)
    saved: list[torch.Tensor] = []
    try:
        with FlopCounterMode(display=False) as fwd:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                out = op(*args, **kwargs)
    except Exception as exc:  # in-place op on a leaf, unsupported meta kernel: retry without grad
        log.debug("op %s with grad failed (%s); measuring forward only", op, exc)
        for t in tensors:
            t.requires_grad_(False)
        saved.clear()
        with FlopCounterMode(display=False) as fwd:
            out = op(*args, **kwargs)
    cost.flops_fwd = fwd.get_total_flops()
    outs = _flatten(out)
    name = str(op)
    if cost.flops_fwd == 0:
        for frag, formula in EXTRA_FORMULAS.items():
            if frag in name:
                cost.flops_fwd = formula(list(args))
                cost.flops_bwd = 2 * cost.flops_fwd if any(t.requires_grad for t in tensors) else 0
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
