"""KVReplicatedParallel: a projection whose query columns are sharded and whose K/V columns stay whole.

Multi-query attention (GPT-BigCode, StarCoder-1: one KV head) cannot give each rank a share of
the KV heads, so Megatron and HF shard the query heads and keep the K/V projection on every rank.
Each rank then computes K and V for all (one) KV heads but uses them only with its own query
heads, so the gradient reaching K/V on a rank is that rank's share of the whole: the K/V weights'
gradients and the projection's input gradient are partial sums, reduced over tp.

The style applies to an ``nn.Linear`` whose output is ``[q | rest]``: ``fused_heads=[q, kv]`` says
its output is q query heads then kv head widths kept whole (a fused [q|k|v] with one KV head,
GPT-BigCode's ``c_attn``: ``[48, 2]``); ``None`` is a K or V projection of its own, kept whole.
Head counts, not widths, so a plan made at the real shape fits a copy with a smaller head dim. Its parameters become replicated
DTensors; in forward rank r computes only the query rows ``[r*q/tp, (r+1)*q/tp)`` and every
other row, returning a plain local tensor ``[q_r | rest]`` (the module's code then cuts it with
local head counts -- PrepareHeadsInput on the attention module). The weight and bias receive
Partial gradients that the gradient-alignment hook all-reduces in backward (one all-reduce per
parameter); the input's gradient is Partial and is reduced where the input was made replicated
(the PrepareModuleInput boundary), together with the query projection's.

``kv_heads`` generalises this to grouped-query attention: each rank computes only the KV heads its
query heads read, rows ``[r*kv/size, (r+1)*kv/size)`` of each kept-whole part (K, V; a fused
[q|k|v]'s k and v). With fewer KV heads than ranks (Starcoder2's 2 at tp=4, Llama-3-70B's 8 at
tp=16; the mesh size a multiple of ``kv_heads``) that is one head, ``r // (size / kv_heads)``, and
the module's code sees one KV head beside its local query heads (PrepareHeadsInput makes its group
count local with ``attribute_divisors``). With ``kv_heads`` a multiple of the mesh size it is
``kv_heads / size`` heads: the form for a fused [q|k|v] of unequal widths (DBRX's Wqkv), which no
strided column shard can cut. Every parameter still stays whole and replicated; the rows a rank
does not use get no gradient there, and the all-reduce sums each row's share from the ranks that
read it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle, check_divides, shard_params, to_dtensor
from hyper_parallel.errors import DivisibilityError, LayoutError, StyleSpecError, UnsupportedModuleError


class KVReplicatedParallel(ParallelStyle):
    """Query heads (the first of ``fused_heads``) column-wise, the rest replicated with their
    gradients reduced over the mesh; see the module docstring."""

    _args = {"fused_heads": None, "kv_heads": None, "input_layouts": None}
    _layout_args = frozenset({"input_layouts"})

    def __init__(self, *, fused_heads: list[int] | None = None, kv_heads: int | None = None,
                 input_layouts: Placement | None = None):
        if fused_heads is not None:
            if not isinstance(fused_heads, (list, tuple)) or len(fused_heads) != 2 or \
                    any(type(h) is not int or h < 0 for h in fused_heads) or sum(fused_heads) == 0:
                raise StyleSpecError(f"KVReplicatedParallel: fused_heads must be [query heads, head widths kept "
                                     f"whole], two ints >= 0, got {fused_heads!r}")
            fused_heads = [int(h) for h in fused_heads]
        if input_layouts is not None and not isinstance(input_layouts, Placement):
            raise LayoutError(f"KVReplicatedParallel: input_layouts must be one Placement, got {input_layouts!r}")
        if kv_heads is not None and (type(kv_heads) is not int or kv_heads < 1):
            raise StyleSpecError(f"KVReplicatedParallel: kv_heads must be an int >= 1 (the KV heads in each "
                                 f"kept-whole part), got {kv_heads!r}")
        if kv_heads is not None and fused_heads is not None and fused_heads[1] % kv_heads:
            raise StyleSpecError(f"KVReplicatedParallel: fused_heads[1]={fused_heads[1]} (head widths kept whole) "
                                 f"is not a multiple of kv_heads={kv_heads}")
        self.fused_heads = fused_heads
        self.kv_heads = kv_heads
        self.input_layouts = input_layouts

    def _query_features(self, module: nn.Linear) -> int:
        if self.fused_heads is None:
            return 0
        return module.out_features // sum(self.fused_heads) * self.fused_heads[0]

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        where = f"KVReplicatedParallel on {fqn or '<root>'}"
        if not isinstance(module, nn.Linear):
            raise UnsupportedModuleError(f"{where}: supports nn.Linear, got {type(module).__name__}")
        if self.fused_heads is not None:
            if module.out_features % sum(self.fused_heads):
                raise DivisibilityError(f"{where}: out_features = {module.out_features} is not {sum(self.fused_heads)} "
                                        f"equal head widths (fused_heads={self.fused_heads})")
            check_divides(self.fused_heads[0], mesh, where, "query heads (fused_heads[0])")
        if self.kv_heads is not None:
            if mesh.size() % self.kv_heads and self.kv_heads % mesh.size():
                raise DivisibilityError(f"{where}: the mesh size {mesh.size()} is neither a multiple nor a divisor of "
                                        f"kv_heads={self.kv_heads} (each rank's query heads must read whole KV heads "
                                        f"no other rank's query heads share)")
            parts = self.fused_heads[1] if self.fused_heads is not None else self.kv_heads
            rest = module.out_features - self._query_features(module)
            if rest % parts:
                raise DivisibilityError(f"{where}: the {rest} kept-whole features are not {parts} equal head widths")

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        where = f"KVReplicatedParallel on {fqn or '<root>'}"
        shard_params(module, mesh, record, {}, Replicate(), fqn)
        q, size, rank = self._query_features(module), mesh.size(), mesh.get_local_rank()
        lo, hi = rank * q // size, (rank + 1) * q // size
        layout = self.input_layouts or Replicate()
        kept = [slice(q, module.out_features)]
        if self.kv_heads is not None:   # only this rank's KV head of each kept-whole part
            parts = self.fused_heads[1] if self.fused_heads is not None else self.kv_heads
            width = (module.out_features - q) // parts
            first = rank * self.kv_heads // size
            last = max((rank + 1) * self.kv_heads // size, first + 1)
            kept = [slice(q + (p * self.kv_heads + first) * width, q + (p * self.kv_heads + last) * width)
                    for p in range(parts // self.kv_heads)]
        rows = ([slice(lo, hi)] if q else []) + kept
        record.set_attr(module, "forward", output_rows_forward(module, mesh, where, layout, rows))
        return module


def output_rows_forward(module: nn.Module, mesh: DeviceMesh, where: str, layout: Placement, rows: list[slice],
                        kind: str = "linear"):
    """The forward of a projection kept whole and replicated that computes only its output rows
    ``rows`` (features, in order): its input made replicated from ``layout``, the weight's and
    bias's rows taken from their local tensors, the result a plain local tensor. A gradient
    arriving at the input or a parameter is this rank's share -- Partial over the mesh --, reduced
    where the input was made replicated and by the gradient-alignment hook. ``kind`` "conv1d":
    transformers' Conv1D, its weight stored [in, out]."""
    out_dim = 0 if kind == "linear" else 1

    def pick(t: torch.Tensor, dim: int) -> torch.Tensor:
        t = t.to_local(grad_placements=(Partial(),)) if isinstance(t, DTensor) else t
        parts = [t.narrow(dim, s.start, s.stop - s.start) for s in rows]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def forward(x: torch.Tensor) -> torch.Tensor:
        x = to_dtensor(x, mesh, layout, Replicate(), where, async_op=False).to_local(grad_placements=(Partial(),))
        weight = pick(module.weight, out_dim)
        bias = pick(module.bias, 0) if module.bias is not None else None
        if kind == "linear":
            return F.linear(x, weight, bias)
        out = x.reshape(-1, x.shape[-1]) @ weight
        out = out + bias if bias is not None else out
        return out.reshape(*x.shape[:-1], weight.shape[1])

    return forward
