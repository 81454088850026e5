"""ParallelStyle: a parallel style is data (to_dict/from_dict, ==, repr) plus an apply step.

Applying is two-phase so a bad plan never leaves a model half-modified: ``validate`` checks a
module without touching it, then ``apply`` records every change (replaced parameters, hooks) in
an :class:`ApplyRecord` that :func:`parallelize_module` can roll back if a later step fails.
Our styles also subclass torch's ParallelStyle, so torch's parallelize_module accepts them.
"""
from __future__ import annotations

import math

import json
from typing import Any, ClassVar

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.parallel.style import ParallelStyle as _TorchParallelStyle

from hyper_parallel.core.dtensor.placements import MAX_TENSOR_DIMS, layouts_from_data, layouts_to_data
from hyper_parallel.errors import DivisibilityError, LayoutError, MeshError, StyleSpecError


class ApplyRecord:
    """Everything one parallelize call changed, so it can be undone in reverse order.

    It also remembers which original parameter became which DTensor parameter, so a parameter
    shared by two modules (tied embedding and LM head) stays one parameter after sharding.
    """

    def __init__(self, src_data_rank: int | None = 0) -> None:
        self.src_data_rank = src_data_rank  # rank whose values are scattered; None = keep local values
        self._undo: list[tuple[str, Any]] = []
        self._shared: dict[int, tuple[tuple[Placement, ...], nn.Parameter]] = {}

    def replace_param(self, module: nn.Module, name: str, new: nn.Parameter) -> None:
        self._undo.append(("param", (module, name, module._parameters[name])))
        module._parameters[name] = new

    def add_hook(self, handle) -> None:
        self._undo.append(("hook", handle))

    def add_flag(self, obj, name: str, value=True) -> None:
        setattr(obj, name, value)
        self._undo.append(("flag", (obj, name)))

    def set_attr(self, obj, name: str, value) -> None:
        """Set an existing attribute, remembering its old value for rollback."""
        self._undo.append(("attr", (obj, name, getattr(obj, name))))
        setattr(obj, name, value)

    def sharded(self, param: nn.Parameter, placements, mesh: DeviceMesh, where: str):
        """The DTensor parameter for ``param``; created once and shared by every user of it."""
        key = id(param)
        placements = tuple(placements)
        if key in self._shared:
            seen, new = self._shared[key]
            if seen != placements:
                raise StyleSpecError(
                    f"{where}: this parameter is shared with a module already sharded as {seen}, "
                    f"but this style needs {placements}; tied parameters need one layout"
                )
            return new
        if isinstance(param, DTensor):
            new = param  # already distributed (e.g. re-applying on an FSDP/TP model): keep as is
        else:
            new = nn.Parameter(
                distribute_tensor(param.detach(), mesh, placements, src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
        self._shared[key] = (placements, new)
        return new

    def repoint_aliases(self, root: nn.Module) -> list[str]:
        """Give every other holder of a replaced parameter the replacement: a module that holds
        the same Parameter object without being styled (BERT's ``cls.predictions.bias`` is the
        decoder's bias; T5's unused ``shared`` table) would keep the old tensor, a second
        parameter the optimizer steps and no forward uses. Only true aliases move: entries that
        are, by identity, a parameter a style replaced. Returns their names."""
        replaced = {id(item[2]): self._shared[id(item[2])][1] for kind, item in self._undo
                    if kind == "param" and id(item[2]) in self._shared}
        moved = []
        for fqn, mod in root.named_modules(remove_duplicate=False):
            for name, p in list(mod._parameters.items()):
                if p is not None and id(p) in replaced and replaced[id(p)] is not p:
                    self.replace_param(mod, name, replaced[id(p)])
                    moved.append(f"{fqn}.{name}" if fqn else name)
        return moved

    def rollback(self) -> None:
        for kind, item in reversed(self._undo):
            if kind == "param":
                module, name, old = item
                module._parameters[name] = old
            elif kind == "flag":
                delattr(*item)
            elif kind == "attr":
                setattr(*item)
            else:
                item.remove()
        self._undo.clear()
        self._shared.clear()


def align_grad_to_param(param: DTensor) -> None:
    """Give a gradient its parameter's layout as soon as it is accumulated.

    DTensor leaves the gradient of a replicated parameter used on sharded activations (a
    sequence-parallel norm) as Partial, and that of a vocabulary-sharded embedding as a full
    Replicate tensor. Left alone, the optimizer would reduce the Partial one inside every op that
    reads it and keep a full-vocabulary gradient on every rank; redistributing here costs one
    all-reduce (Partial) or a local slice (Replicate -> Shard) per step, in backward.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


class ParallelStyle(_TorchParallelStyle):
    """Base of hyper_parallel styles. Subclasses define ``_args`` (name -> default) and
    ``_layout_args`` (the arguments that hold placements), ``check_module`` and ``apply``."""

    _args: ClassVar[dict[str, Any]] = {}
    _layout_args: ClassVar[frozenset[str]] = frozenset()
    src_data_rank: int | None = 0

    # ---- data -------------------------------------------------------------------------------
    def args(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._args}

    def to_dict(self) -> dict[str, Any]:
        """{"style": ClassName, "args": {...}} with only non-default arguments, JSON-able."""
        out = {}
        for name, default in self._args.items():
            value = getattr(self, name)
            if value == default and type(value) is type(default):
                continue
            out[name] = layouts_to_data(value) if name in self._layout_args else value
        return {"style": type(self).__name__, "args": out}

    @classmethod
    def from_args_data(cls, data: dict[str, Any]) -> "ParallelStyle":
        unknown = set(data) - set(cls._args)
        if unknown:
            raise StyleSpecError(
                f"{cls.__name__}: unknown argument(s) {sorted(unknown)}; known: {sorted(cls._args)}"
            )
        for k, v in data.items():  # a plan file is data: "false" is not False, 1.0 is not 1
            default = cls._args[k]
            if k in cls._layout_args or default is None:
                continue
            if type(v) is not type(default):
                raise StyleSpecError(f"{cls.__name__}.{k}: {v!r} must be of type {type(default).__name__} "
                                     f"(like the default {default!r})")
            if type(v) is int and not -MAX_TENSOR_DIMS <= v < MAX_TENSOR_DIMS:
                raise StyleSpecError(f"{cls.__name__}.{k}: {v} is not a tensor dimension "
                                     f"(valid: {-MAX_TENSOR_DIMS} <= dim < {MAX_TENSOR_DIMS})")
        kwargs = {
            k: layouts_from_data(v, where=f"{cls.__name__}.{k}") if k in cls._layout_args else v
            for k, v in data.items()
        }
        return cls(**kwargs)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.to_dict() == other.to_dict()  # type: ignore[union-attr]

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args().items() if v != self._args[k] or
                         type(v) is not type(self._args[k]))
        return f"{type(self).__name__}({args})"

    # ---- application --------------------------------------------------------------------------
    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        """Raise a typed error if this style cannot be applied to ``module``; change nothing."""

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        raise NotImplementedError

    def param_shard_dims(self, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, bool]] | None:
        """The dimension each parameter this style shards is split on over a one-dimensional
        mesh, and whether the split is strided, by its path under the styled module (``params``:
        every parameter under it with its shape, the module's own and its submodules');
        parameters left out stay replicated. A planner that holds only a model's shapes predicts
        per-rank bytes (and where FSDP2 shards next) from this, so a style that shards parameters
        its own way says so here, from the placements its ``apply`` uses. None: the style does
        not say (ColwiseParallel / RowwiseParallel: the layer type decides)."""
        return None

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """torch's ParallelStyle entry point (used when torch's parallelize_module is given our style)."""
        check_mesh_1d(device_mesh, type(self).__name__)
        self.check_module(module, device_mesh, "")
        return self.apply(module, device_mesh, ApplyRecord(self.src_data_rank), "")


def check_mesh_1d(mesh: DeviceMesh, where: str) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise MeshError(f"{where}: expected a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise MeshError(
            f"{where}: tensor-parallel styles need a 1-D mesh, got {mesh.ndim}-D mesh "
            f"{tuple(mesh.shape)} named {mesh.mesh_dim_names}; pass a sub-mesh such as mesh['tp']"
        )


def check_divides(size: int, mesh: DeviceMesh, where: str, what: str) -> None:
    n = mesh.size()
    if size % n:
        raise DivisibilityError(f"{where}: {what} = {size} is not divisible by the mesh size {n}")


KEEP_PARTIAL_GRADS = "_hp_keep_partial_grads"
"""Module flag: leave its parameters' gradients as DTensor produces them (torch's SequenceParallel)."""


def _ensure_grad_alignment(module: nn.Module, inputs) -> None:
    """Forward pre-hook: make sure every DTensor parameter of ``module`` carries the gradient
    alignment hook. Done lazily, at forward time, because ``module.to_empty()`` (meta
    initialisation after sharding) replaces parameter objects and would drop hooks set earlier.
    A module flagged ``KEEP_PARTIAL_GRADS`` is skipped (its gradients stay Partial, as torch's)."""
    if getattr(module, KEEP_PARTIAL_GRADS, False):
        return
    for p in module.parameters(recurse=False):
        if isinstance(p, DTensor) and p.requires_grad and not getattr(p, "_hp_grad_aligned", False):
            p.register_post_accumulate_grad_hook(align_grad_to_param)
            p._hp_grad_aligned = True


def shard_params(module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, placements: dict[str, Placement],
                 default: Placement, fqn: str, recurse: bool = False, only: bool = False) -> None:
    """Replace each parameter of ``module`` (and of its submodules if ``recurse``) by a DTensor.

    ``placements`` maps a direct parameter name to its placement; others get ``default`` -- or,
    with ``only``, stay as they are (a module whose own code reads some of its parameters whole).
    """
    subs = module.named_modules() if recurse else [("", module)]
    for sub_fqn, sub in subs:
        if not getattr(sub, "_hp_align_hook", False) and sub._parameters:
            record.add_hook(sub.register_forward_pre_hook(_ensure_grad_alignment))
            record.add_flag(sub, "_hp_align_hook")
        for name, param in list(sub._parameters.items()):
            if param is None or (only and (sub is not module or name not in placements)):
                continue
            placement = placements.get(name, default) if sub is module else default
            where = ".".join(x for x in (fqn or type(module).__name__, sub_fqn, name) if x)
            new = record.sharded(param, (placement,), mesh, where=where)
            record.replace_param(sub, name, new)


def to_dtensor(x: torch.Tensor, mesh: DeviceMesh, layout: Placement, desired: Placement | None,
               where: str, global_size: int | None = None, async_op: bool = True) -> DTensor:
    """Annotate a local tensor with ``layout`` (or take a DTensor as is), then move it to ``desired``.

    ``async_op``: leave the collective in flight (DTensor waits at the first op that reads the
    result). A caller that hands the result's local tensor to code outside the style passes
    False -- see :func:`finish_output` for why such a tensor must not be in flight.

    ``global_size``: the whole size of the dimension ``layout`` shards, when the caller knows it
    (a RowwiseParallel Linear: its in_features). DTensor cannot infer it from an uneven shard
    (10 features over 4 ranks are 3, 3, 2, 2 locally; each rank would guess 4x its own), so it is
    given explicitly and the shards may be uneven, as DTensor's own Shard allows."""
    for what, p in (("layout", layout), ("desired layout", desired)):
        if isinstance(p, Shard) and not -x.ndim <= p.dim < x.ndim:
            raise LayoutError(f"{where}: {what} Shard({p.dim}) names a dimension the {x.ndim}-D input of shape "
                              f"{tuple(x.shape)} does not have (valid: Shard(d) with {-x.ndim} <= d < {x.ndim})")
    if not isinstance(x, DTensor):
        shape = stride = None
        if global_size is not None and isinstance(layout, Shard):
            dims = list(x.shape)
            dims[layout.dim % x.ndim] = int(global_size)
            shape = torch.Size(dims)
            stride = tuple(math.prod(dims[i + 1:]) for i in range(len(dims)))
        x = DTensor.from_local(x, mesh, (layout,), run_check=False, shape=shape, stride=stride)
    if desired is not None and x.placements != (desired,):
        if isinstance(desired, Shard) and not any(isinstance(p, Shard) for p in x.placements):
            dim = desired.dim % x.ndim
            check_divides(x.shape[dim], mesh, where, f"tensor dim {dim} of shape {tuple(x.shape)}")
        x = x.redistribute(placements=(desired,), async_op=async_op)
    return x


def finish_output(out, mesh: DeviceMesh, layout: Placement | None, use_local: bool, where: str,
                  owned: bool = False):
    """Redistribute a module output to ``layout`` and optionally return its local tensor
    (``owned``: a copy the caller may modify in place; DTensor's local view may not be).

    A local output is redistributed synchronously. An in-flight collective's local tensor is an
    ``AsyncCollectiveTensor`` wrapper that carries the autograd history; a compiled region that
    receives one (the next decoder layer under ``layer.compile()``) unwraps it to the waited,
    history-less tensor (AOT autograd's ``trigger_wait``), so the gradient of everything before
    it is lost: a crash in a later collective's backward under tensor parallel, silently missing
    gradients (the embedding's) under FSDP. The output is read by the very next op (a residual
    add), so waiting here costs no overlap. A DTensor output stays in flight."""
    if not isinstance(out, DTensor):
        raise StyleSpecError(f"{where}: expected the module to return a DTensor, got {type(out).__name__}")
    if layout is not None and out.placements != (layout,):
        out = out.redistribute(placements=(layout,), async_op=not use_local)
    if not use_local:
        return out
    return out.to_local().clone() if owned else out.to_local()


def shard_dims(placements: dict[str, Placement]) -> dict[str, tuple[int, bool]]:
    """{path: (dim, strided)} of the Shard placements in ``placements`` (Replicate left out)."""
    return {path: (p.dim, isinstance(p, _StridedShard)) for path, p in placements.items()
            if isinstance(p, (Shard, _StridedShard))}
