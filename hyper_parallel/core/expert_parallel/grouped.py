"""Grouped expert GEMM: rows sorted by expert, one matrix per expert, one call where torch has one.

torch 2.13 ships ``torch._grouped_mm`` with a CPU kernel (float32/bfloat16/float16) that needs
16-byte aligned row strides; its backward rejects a non-contiguous incoming gradient (e.g. the
expanded gradient of ``.sum()``), so the output passes through :class:`_ContiguousGrad`. Where
the kernel does not apply (float64, odd widths, other devices) a per-expert loop computes the
same product; both are autograd-differentiable. On CUDA only bfloat16 takes the kernel (the dtype
torch's CUDA grouped GEMM is built for; not exercised on this CPU-only machine); meta and fake
tensors (dry runs) take the loop, whose shapes are all a dry run needs.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (what _grouped_mm's backward needs)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _aligned(n: int, dtype: torch.dtype) -> bool:
    return (n * torch.empty((), dtype=dtype).element_size()) % 16 == 0


def grouped_kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes ``x [N, in] @ weight [E, in, out]`` as given."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or x.dtype != weight.dtype or x.dtype not in _GROUPED_DTYPES:
        return False
    if x.device.type not in ("cpu", "cuda") or (x.device.type == "cuda" and x.dtype != torch.bfloat16):
        return False
    if x.is_meta or is_fake(x):  # the op's shape function accepts bfloat16 only (CUDA's rule)
        return False
    return all(_aligned(n, x.dtype) for n in (weight.shape[1], weight.shape[2])) and x.shape[0] > 0


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """``x`` rows grouped by expert (``counts[e]`` rows for expert e, in order) times
    ``weight [E, in, out]`` (``weight[e]`` for its rows): [N, out]."""
    if grouped_kernel_applies(x, weight):
        w = weight if weight.stride(-1) == 1 or weight.stride(-2) == 1 else weight.contiguous()
        offs = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
        return _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), w, offs=offs))
    pieces, start = [], 0
    for e, n in enumerate(counts):
        pieces.append(x[start:start + n] @ weight[e])
        start += n
    if not pieces:   # no local expert (ep does not divide E): an empty product still in the graph, so
        return x @ weight.sum(0)   # this rank's backward all-to-alls run as its peers' do
    return torch.cat(pieces, dim=0)
