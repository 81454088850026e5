"""Run a meta model as if it lived on a real device, with fake tensors (no memory either way).

Meta tensors do not mix with tensors a forward creates without a device (``torch.ones(n)`` is
on the CPU), so such a model fails on meta although it runs eagerly. Under ``FakeTensorMode``
the parameters become fake CPU tensors and so does every tensor the forward creates: shapes,
dtypes and devices all agree, and still nothing is allocated. Capture tries this after meta.

With ``keep_values`` the inputs that hold values (real CPU tensors) keep them beside their fakes
(torch's real-tensor propagation): an op reading only such values -- a filter on the pixels, a
boolean mask of image tokens, sizes made from Python ints -- gets its real result, so the sizes it
makes are known; an op touching a weight (which has no values) stays shapes only. Export is run
inside :func:`tracing` so that it fakifies the inputs in this mode, beside the weights.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch._functorch.config as functorch_config
import torch.fx.experimental._config as fx_config
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._guards import TracingContext
from torch._guards import tracing as _tracing
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._pytree import tree_map


def is_fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def fake_device(
    model: nn.Module, args: tuple, kwargs: dict, device: str = "cpu", keep_values: bool = False
) -> Iterator[tuple[FakeTensorMode, tuple, dict]]:
    """Give ``model`` fake parameters and buffers on ``device`` until exit (ties kept, originals
    restored); yields the fake mode and the inputs as fake tensors on ``device`` -- with
    ``keep_values``, those with values on ``device`` as they are (see the module docstring)."""
    mode = valued_mode() if keep_values else FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, Any]] = []

    def fake_of(t: torch.Tensor, as_param: bool) -> torch.Tensor:
        if id(t) not in fakes:
            f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
            fakes[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if as_param else f
        return fakes[id(t)]

    try:
        with mode:
            for mod in model.modules():
                for table, as_param in ((mod._parameters, True), (mod._buffers, False)):
                    for name, t in list(table.items()):
                        if t is None:
                            continue
                        swapped.append((table, name, t))
                        table[name] = fake_of(t, as_param)

            def convert(x):
                if not isinstance(x, torch.Tensor):
                    return x
                if keep_values and x.device.type == device and not (x.is_meta or is_fake(x)):
                    return x   # export fakifies it in this mode (tracing), its values beside it
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)

            fargs, fkwargs = tree_map(convert, tuple(args)), tree_map(convert, dict(kwargs))
        yield mode, fargs, fkwargs
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t


def valued_mode() -> FakeTensorMode:
    """A fake mode with a shape environment (naming the sizes values resolve) that can propagate
    real tensors, switched off: what is made in it before :func:`values_on` (the weights) has no
    values."""
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(tracked_fakes=[]))
    mode.propagate_real_tensors = False
    return mode


@contextlib.contextmanager
def values_on(mode: FakeTensorMode):
    """Real-tensor propagation on in ``mode`` (a :func:`valued_mode`) for the block. A size the
    values fixed may be a constant where torch expected a fresh symbol (a boolean mask indexing
    twice): known is as good as bound, so that is a note in torch's debug log, not an error; and
    where a kernel's fake output aliases otherwise than its real one (a collective on a tensor the
    forward made from nothing), the real one's metadata is taken."""
    mode.propagate_real_tensors = True
    try:
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True,
                                    generate_fake_kernels_from_real_mismatches=True), \
                fx_config.patch(soft_pending_unbacked_not_found_error=True):
            yield
    finally:
        mode.propagate_real_tensors = False


@contextlib.contextmanager
def tracing(mode: FakeTensorMode, keep_values: bool):
    """Export inside this: with ``keep_values``, in ``mode`` (its weights are this mode's fakes,
    which another mode would take for values) with real-tensor propagation on; else nothing."""
    if not keep_values:
        yield
        return
    with values_on(mode), _tracing(TracingContext(mode)):
        yield
