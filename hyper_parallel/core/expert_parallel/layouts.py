"""The two shapes an experts container comes in, and how each computes its local experts.

- ``stacked``: 3-D parameters, transformers 5.x style (Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS,
  the repo MoE model): ``gate_up_proj`` [E, 2F, H] and ``down_proj`` [E, H, F], or transposed
  ([E, H, 2F], [E, F, H], ``is_transposed=True``: GPT-OSS), optional ``gate_up_proj_bias``
  [E, 2F] / ``down_proj_bias`` [E, H]; the gate and up halves are concatenated ([gate|up],
  ``is_concatenated=True``) or interleaved (GPT-OSS); the module's ``_apply_gate`` (transformers
  installs one on every experts class) turns the gate_up output into the down input.
- ``list``: one ``nn.ModuleList`` child of E expert MLPs (each maps [n, H] -> [n, H]).

Both are called as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hyper_parallel.core.expert_parallel.grouped import grouped_mm
from hyper_parallel.errors import UnsupportedModuleError


@dataclass(frozen=True)
class ExpertsLayout:
    kind: str                  # "stacked" | "list"
    num_experts: int
    hidden: int                # H (0 for a ModuleList: each expert knows its own)
    ffn: int                   # F: the width tensor parallelism splits (gate_up has 2F); 0 for a ModuleList
    transposed: bool = False   # weights stored [in, out] per expert
    concatenated: bool = True  # [gate|up] halves (False: interleaved gate/up columns)
    biases: bool = False
    list_name: str = ""        # the ModuleList child (kind "list")


def _signature_ok(module: nn.Module) -> bool:
    """forward(hidden_states, top_k_index, top_k_weights): three positional parameters."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_extra = [p for p in positional[3:] if p.default is p.empty]
    return len(positional) >= 3 and not required_extra


def read_layout(module: nn.Module, where: str) -> ExpertsLayout:
    """The layout of an experts container, or an UnsupportedModuleError saying what is expected."""
    expected = ("an experts container called as experts(hidden_states, top_k_index, top_k_weights) that holds "
                "3-D gate_up_proj/down_proj parameters or one nn.ModuleList of expert MLPs")
    if not _signature_ok(module):
        raise UnsupportedModuleError(f"{where}: {type(module).__name__} has no forward(hidden_states, top_k_index, "
                                     f"top_k_weights); expected {expected}")
    params = dict(module.named_parameters(recurse=False))
    gu, down = params.get("gate_up_proj"), params.get("down_proj")
    if gu is not None and down is not None and gu.ndim == 3 and down.ndim == 3:
        if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
            raise UnsupportedModuleError(f"{where}: experts without a gate or with a post-expert norm are not "
                                         f"supported (valid: has_gate=True, has_post_expert_norm=False)")
        transposed = bool(getattr(module, "is_transposed", False))
        e = gu.shape[0]
        h, two_f = (gu.shape[1], gu.shape[2]) if transposed else (gu.shape[2], gu.shape[1])
        want_down = (e, two_f // 2, h) if transposed else (e, h, two_f // 2)
        if two_f % 2 or tuple(down.shape) != want_down:
            raise UnsupportedModuleError(
                f"{where}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} do not match "
                f"(is_transposed={transposed}: expected down_proj {want_down})")
        biases = "gate_up_proj_bias" in params or "down_proj_bias" in params
        if biases and not ("gate_up_proj_bias" in params and "down_proj_bias" in params):
            raise UnsupportedModuleError(f"{where}: expected both gate_up_proj_bias and down_proj_bias, or neither")
        return ExpertsLayout("stacked", e, h, two_f // 2, transposed,
                             bool(getattr(module, "is_concatenated", True)), biases)
    lists = [(n, c) for n, c in module.named_children() if isinstance(c, nn.ModuleList)]
    if len(lists) == 1 and not params and all(any(True for _ in e.parameters()) for e in lists[0][1]):
        name, experts = lists[0]
        if len(experts):
            return ExpertsLayout("list", len(experts), 0, 0, list_name=name)
    raise UnsupportedModuleError(f"{where}: {type(module).__name__} is not an experts container; expected {expected}")


def local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's local shard (autograd flows back to the DTensor parameter)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _apply_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    gate_fn = getattr(module, "_apply_gate", None)
    if gate_fn is not None:
        return gate_fn(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def stacked_experts(module: nn.Module, layout: ExpertsLayout, x: torch.Tensor, counts: list[int],
                    reduce_tp=None) -> torch.Tensor:
    """Rows of ``x`` grouped by local expert through the local (ep- and tp-) shards of the weights.

    ``reduce_tp`` sums the tensor-parallel partial outputs (before the down bias and the routing
    weight, as a row-wise linear layer does)."""
    gu, down = local(module.gate_up_proj), local(module.down_proj)
    if not layout.transposed:  # [E, out, in] -> [E, in, out]
        gu, down = gu.transpose(-2, -1), down.transpose(-2, -1)
    expert_of_row = None
    if layout.biases:
        expert_of_row = torch.cat([torch.full((n,), e, dtype=torch.long, device=x.device)  # sizes only: fake-safe
                                   for e, n in enumerate(counts)] + [torch.zeros(0, dtype=torch.long, device=x.device)])
    h = grouped_mm(x, gu, counts)
    if layout.biases:
        h = h + local(module.gate_up_proj_bias)[expert_of_row]
    h = _apply_gate(module, h)
    out = grouped_mm(h, down, counts)
    if reduce_tp is not None:
        out = reduce_tp(out)
    if layout.biases:
        out = out + local(module.down_proj_bias)[expert_of_row]
    return out


def list_experts(module: nn.Module, layout: ExpertsLayout, first: int, x: torch.Tensor,
                 counts: list[int]) -> torch.Tensor:
    """Rows grouped by local expert through this rank's experts ``first, first+1, ...``."""
    experts = getattr(module, layout.list_name)
    pieces, start = [], 0
    for i, n in enumerate(counts):
        pieces.append(experts[first + i](x[start:start + n]))
        start += n
    return torch.cat(pieces, dim=0) if pieces else x * 0   # no local expert: empty, still in the graph
