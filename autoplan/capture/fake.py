"""Run a meta model as if it lived on a real device, with fake tensors (no memory either way).

Meta tensors do not mix with tensors a forward creates without a device (``torch.ones(n)`` is
on the CPU), so such a model fails on meta although it runs eagerly. Under ``FakeTensorMode``
the parameters become fake CPU tensors and so does every tensor the forward creates: shapes,
dtypes and devices all agree, and still nothing is allocated. Capture tries this after meta.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_map


def is_fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)


@contextlib.contextmanager
def fake_device(
    model: nn.Module, args: tuple, kwargs: dict, device: str = "cpu"
) -> Iterator[tuple[FakeTensorMode, tuple, dict]]:
    """Give ``model`` fake parameters and buffers on ``device`` until exit (ties kept, originals
    restored); yields the fake mode and the inputs as fake tensors on ``device``."""
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

            def convert(x):
                if isinstance(x, torch.Tensor):
                    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
                return x

            fargs, fkwargs = tree_map(convert, tuple(args)), tree_map(convert, dict(kwargs))
        yield mode, fargs, fkwargs
    finally:
        for table, name, t in reversed(swapped):
            table[name] = t
