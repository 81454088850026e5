"""PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput: layout changes at a
module boundary, with no parameters touched.

Inputs beyond ``input_layouts`` are left alone, so a plan can name only the hidden-state input
of a block that also receives position tables or masks.

They are how a plan says "this block receives a sequence shard but computes on the whole
sequence" (all-gather) or "hand the next stage a replicated tensor". Positional layouts are
also matched by parameter name, so a model that passes ``hidden_states=`` as a keyword (HF)
works with the same positional plan; ``None`` means leave that input alone.
"""
from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement

from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle, to_dtensor
from hyper_parallel.errors import LayoutError

Layouts = Placement | tuple[Placement | None, ...] | None


def _as_tuple(value: Layouts, where: str, name: str) -> tuple | None:
    if value is None:
        return None
    if isinstance(value, Placement):
        return (value,)
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, Placement) for v in value):
        return tuple(value)
    raise LayoutError(f"{where}: {name} must be a Placement or a tuple of Placement/None, got {value!r}")


def _check_pair(layouts, desired, where: str, a: str, b: str) -> None:
    if (layouts is None) != (desired is None):
        raise LayoutError(f"{where}: {a} and {b} must be given together")
    if layouts is None:
        return
    if len(layouts) != len(desired):
        raise LayoutError(f"{where}: {a} has {len(layouts)} entries but {b} has {len(desired)}")
    for i, (x, y) in enumerate(zip(layouts, desired)):
        if (x is None) != (y is None):
            raise LayoutError(f"{where}: entry {i} is None in one of {a}/{b} but not the other")


def _convert(x: Any, layout, desired, mesh: DeviceMesh, use_local: bool, where: str, which: tuple):
    """``where`` (the style on its module) and ``which`` (the input or output) are joined only in
    an error: under ``torch.compile`` a string formatted on the normal path is a guard, and a
    guard on the module's name recompiles every identical block."""
    if layout is None:
        return x
    if not isinstance(x, torch.Tensor):
        raise LayoutError(f"{where} {which[0]} {which[1]!r}: expected a tensor for layout {layout}, got {type(x).__name__}")
    out = to_dtensor(x, mesh, layout, desired, where, async_op=not use_local)   # see finish_output
    return out.to_local() if use_local else out


def _positional_names(module: nn.Module) -> tuple[list[str], bool]:
    """Names of forward's positional parameters, and whether it takes *args."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return [], True
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names, any(p.kind == p.VAR_POSITIONAL for p in params)


class PrepareModuleInput(ParallelStyle):
    """Annotate and redistribute a module's inputs (positional and keyword)."""

    _args = {"input_layouts": None, "desired_input_layouts": None, "input_kwarg_layouts": None,
             "desired_input_kwarg_layouts": None, "use_local_output": False}
    _layout_args = frozenset({"input_layouts", "desired_input_layouts", "input_kwarg_layouts",
                              "desired_input_kwarg_layouts"})

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_output: bool = False):
        where = type(self).__name__
        self.input_layouts = _as_tuple(input_layouts, where, "input_layouts")
        self.desired_input_layouts = _as_tuple(desired_input_layouts, where, "desired_input_layouts")
        _check_pair(self.input_layouts, self.desired_input_layouts, where,
                    "input_layouts", "desired_input_layouts")
        kw, dkw = input_kwarg_layouts or None, desired_input_kwarg_layouts or None
        if (kw is None) != (dkw is None) or (kw is not None and set(kw) != set(dkw)):
            raise LayoutError(f"{where}: input_kwarg_layouts and desired_input_kwarg_layouts need the same keys")
        for name, p in list((kw or {}).items()) + list((dkw or {}).items()):
            if not isinstance(p, Placement):
                raise LayoutError(f"{where}: kwarg layout for {name!r} must be a Placement, got {p!r}")
        self.input_kwarg_layouts = dict(kw) if kw else None
        self.desired_input_kwarg_layouts = dict(dkw) if dkw else None
        self.use_local_output = bool(use_local_output)

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        names, varargs = _positional_names(module)
        n = len(self.input_layouts or ())
        if not varargs and n > len(names):
            raise LayoutError(
                f"{type(self).__name__} on {fqn or '<root>'}: input_layouts has {n} entries but "
                f"{type(module).__name__}.forward takes {len(names)} positional input(s) {names}"
            )

    def _prepare(self, module: nn.Module, mesh: DeviceMesh, fqn: str):
        where = f"{type(self).__name__} on {fqn or '<root>'}"
        names, _ = _positional_names(module)
        layouts = self.input_layouts or ()
        desired = self.desired_input_layouts or ()

        def pre_hook(mod, args, kwargs):
            # positional inputs beyond input_layouts are left alone (like None); more layouts
            # than forward accepts is caught in check_module, a layout with no input below
            args, kwargs = list(args), dict(kwargs)
            for i, (layout, want) in enumerate(zip(layouts, desired)):
                if i < len(args):
                    args[i] = _convert(args[i], layout, want, mesh, self.use_local_output, where, ("input", i))
                    continue
                name = names[i] if i < len(names) else None
                if name is not None and name in kwargs:
                    kwargs[name] = _convert(kwargs[name], layout, want, mesh, self.use_local_output,
                                            where, ("input", name))
                elif layout is not None:
                    raise LayoutError(f"{where}: input {i} ({name or '?'}) has layout {layout} but was not passed")
            for name, layout in (self.input_kwarg_layouts or {}).items():
                if name in kwargs:
                    kwargs[name] = _convert(kwargs[name], layout, self.desired_input_kwarg_layouts[name], mesh,
                                            self.use_local_output, where, ("kwarg", name))
            return tuple(args), kwargs

        return pre_hook

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        record.add_hook(module.register_forward_pre_hook(self._prepare(module, mesh, fqn), with_kwargs=True))
        return module


class PrepareModuleOutput(ParallelStyle):
    """Annotate and redistribute a module's output(s)."""

    _args = {"output_layouts": None, "desired_output_layouts": None, "use_local_output": True}
    _layout_args = frozenset({"output_layouts", "desired_output_layouts"})

    def __init__(self, *, output_layouts: Layouts, desired_output_layouts: Layouts, use_local_output: bool = True):
        where = type(self).__name__
        self.output_layouts = _as_tuple(output_layouts, where, "output_layouts")
        self.desired_output_layouts = _as_tuple(desired_output_layouts, where, "desired_output_layouts")
        if self.output_layouts is None:
            raise LayoutError(f"{where}: output_layouts is required")
        _check_pair(self.output_layouts, self.desired_output_layouts, where,
                    "output_layouts", "desired_output_layouts")
        self.use_local_output = bool(use_local_output)

    def _finish(self, mesh: DeviceMesh, fqn: str):
        where = f"{type(self).__name__} on {fqn or '<root>'}"

        def post_hook(mod, inputs, out):
            single = not isinstance(out, tuple)
            outs = (out,) if single else out
            if len(outs) != len(self.output_layouts):
                raise LayoutError(
                    f"{where}: module returned {len(outs)} output(s) but output_layouts has "
                    f"{len(self.output_layouts)}"
                )
            done = tuple(
                _convert(o, lay, want, mesh, self.use_local_output, where, ("output", i))
                for i, (o, lay, want) in enumerate(zip(outs, self.output_layouts, self.desired_output_layouts))
            )
            return done[0] if single else done

        return post_hook

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        record.add_hook(module.register_forward_hook(self._finish(mesh, fqn)))
        return module


class PrepareModuleInputOutput(ParallelStyle):
    """PrepareModuleInput and PrepareModuleOutput on one module."""

    _args = {"input_layouts": None, "desired_input_layouts": None, "input_kwarg_layouts": None,
             "desired_input_kwarg_layouts": None, "use_local_input": False,
             "output_layouts": None, "desired_output_layouts": None, "use_local_output": True}
    _layout_args = PrepareModuleInput._layout_args | PrepareModuleOutput._layout_args

    def __init__(self, *, input_layouts: Layouts = None, desired_input_layouts: Layouts = None,
                 input_kwarg_layouts: dict[str, Placement] | None = None,
                 desired_input_kwarg_layouts: dict[str, Placement] | None = None,
                 use_local_input: bool = False, output_layouts: Layouts, desired_output_layouts: Layouts,
                 use_local_output: bool = True):
        self._inp = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self._out = PrepareModuleOutput(output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
                                        use_local_output=use_local_output)
        self.input_layouts = self._inp.input_layouts
        self.desired_input_layouts = self._inp.desired_input_layouts
        self.input_kwarg_layouts = self._inp.input_kwarg_layouts
        self.desired_input_kwarg_layouts = self._inp.desired_input_kwarg_layouts
        self.use_local_input = bool(use_local_input)
        self.output_layouts = self._out.output_layouts
        self.desired_output_layouts = self._out.desired_output_layouts
        self.use_local_output = bool(use_local_output)

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        self._inp.check_module(module, mesh, fqn)

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        self._inp.apply(module, mesh, record, fqn)
        self._out.apply(module, mesh, record, fqn)
        return module
