"""Op specs: one ATen call described by data (op name, tensor shapes/dtypes/strides, other args).

The profiler replays specs on real tensors and the compute model prices them, so both work from
this one description. Specs come from :func:`record_ops` (run a function on fake tensors under a
dispatch mode; sees forward *and* backward ops, as the device would run them); the planner above
builds them from its captured graphs and models (``autoplan.capture.views.specs_from_graph``,
``autoplan.models.llama_ops``).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from cost_models.errors import CostModelError

log = logging.getLogger(__name__)

REPLAY_DEVICE = "<device>"  # stands for "the device the op is replayed on" inside recorded args


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str                      # "torch.float32"
    stride: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        import torch

        return getattr(torch, self.dtype.split(".")[-1]).itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def __str__(self) -> str:
        return f"{self.dtype.split('.')[-1]}{list(self.shape)}"


@dataclass(frozen=True)
class OpSpec:
    """One distinct op call; ``args``/``kwargs`` hold TensorSpecs where tensors were passed."""

    op: str                                  # "aten.mm.default"
    args: tuple = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    count: int = 1                           # occurrences per training step (or per forward)
    phase: str = "fwd"                       # "fwd" or "bwd"
    out: tuple[TensorSpec, ...] = field(default=(), compare=False)

    @property
    def key(self) -> str:
        """Identity of the call for dedup and for the profile table (count and phase excluded)."""
        return f"{self.op}({_fmt(self.args)}{', ' if self.kwargs else ''}{_fmt_kw(self.kwargs)})"

    @property
    def tensors(self) -> list[TensorSpec]:
        return [t for t in _flatten((self.args, tuple(v for _, v in self.kwargs))) if isinstance(t, TensorSpec)]

    @property
    def short_name(self) -> str:
        parts = self.op.split(".")
        return parts[1] if len(parts) > 1 else self.op


def _flatten(x):
    if isinstance(x, (tuple, list)):
        for y in x:
            yield from _flatten(y)
    else:
        yield x


def _fmt(x) -> str:
    if isinstance(x, TensorSpec):
        st = "" if x.stride is None or x.stride == _contig(x.shape) else f"@{list(x.stride)}"
        return f"{x}{st}"
    if isinstance(x, tuple) and x[:1] == ("__list__",):
        return "[" + ", ".join(_fmt(y) for y in x[1:]) + "]"
    if isinstance(x, (tuple, list)):
        return ", ".join(_fmt(y) for y in x)
    return repr(x)


def _fmt_kw(kw) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in kw)


def _contig(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def _freeze(x, torch):
    """Recorded argument -> hashable, device-free data."""
    if isinstance(x, torch.Tensor):
        return TensorSpec(tuple(x.shape), str(x.dtype), tuple(x.stride()))
    if isinstance(x, (list, tuple)):
        return type(x)(_freeze(y, torch) for y in x) if isinstance(x, tuple) else [_freeze(y, torch) for y in x]
    if isinstance(x, torch.device):
        return REPLAY_DEVICE
    if isinstance(x, (torch.dtype, torch.memory_format, torch.layout)):
        return str(x)
    return x


def _hashable(x):
    if isinstance(x, list):
        return ("__list__",) + tuple(_hashable(y) for y in x)
    if isinstance(x, tuple):
        return tuple(_hashable(y) for y in x)
    return x


def dedupe(specs: Iterable[OpSpec]) -> list[OpSpec]:
    """Merge specs with the same call and phase, adding their counts; first-seen order."""
    merged: "OrderedDict[tuple, OpSpec]" = OrderedDict()
    for s in specs:
        k = (s.phase, s.key)
        if k in merged:
            merged[k] = replace(merged[k], count=merged[k].count + s.count)
        else:
            merged[k] = s
    return list(merged.values())


_SKIP = {"aten.detach.default", "aten.lift_fresh.default", "prim.device.default", "aten._local_scalar_dense.default"}


def record_ops(fn: Callable[[], Any], backward: Callable[[Any], None] | None = None,
               count: int = 1) -> list[OpSpec]:
    """ATen calls made by ``fn()`` (phase fwd) and by ``backward(fn's result)`` (phase bwd), deduplicated.

    Run it on fake tensors (``fake_cpu()``) or meta tensors: nothing is computed or allocated.
    Fake CPU tensors are better: kernels are chosen as on the real device (e.g. SDPA picks the
    CPU flash kernel, where meta tensors fall back to the math decomposition).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[OpSpec] = []
    phase = ["fwd"]

    class _Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = str(func)
            if name not in _SKIP:
                outs = tuple(_freeze(o, torch) for o in _flatten(out) if isinstance(o, torch.Tensor))
                calls.append(OpSpec(
                    op=name, args=_hashable(_freeze(tuple(args), torch)),
                    kwargs=tuple(sorted((k, _hashable(_freeze(v, torch))) for k, v in kwargs.items())),
                    count=count, phase=phase[0], out=outs))
            return out

    with _Recorder():
        result = fn()
        if backward is not None:
            phase[0] = "bwd"
            backward(result)
    return dedupe(calls)


def fake_cpu():
    """A FakeTensorMode: tensors created inside look like CPU tensors but hold no memory."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


class default_dtype:
    """Build modules directly in ``dtype`` (``.to(dtype)`` cannot swap fake parameters)."""

    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        import torch

        self.old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        import torch

        torch.set_default_dtype(self.old)
