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
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
import torch.fx.experimental._config as fx_config
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
    if keep_values:   # the mode's shape environment names the sizes the values resolve
        with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
            mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(tracked_fakes=[]))
        mode.propagate_real_tensors = False   # the weights are made without values
    else:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
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

            mode.propagate_real_tensors = keep_values

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


@contextlib.contextmanager
def tracing(mode: FakeTensorMode, keep_values: bool):
    """Export inside this: with ``keep_values``, in ``mode`` (its weights are this mode's fakes,
    which another mode would take for values) with real-tensor propagation on; else nothing."""
    if not keep_values:
        yield
        return
    # a size the values fixed may be a constant where torch expected a fresh symbol (a boolean mask
    # indexing twice): known is as good as bound, so that is a note in the debug log, not an error
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True), \
            fx_config.patch(soft_pending_unbacked_not_found_error=True), _tracing(TracingContext(mode)):
        yield
