"""PrepareHeadsInput: an attention module whose heads are sharded, for code that cuts by head counts.

Column-parallel q/k/v give each rank whole heads, but some attention code cuts its projection's
output by the *global* head count or width it stores: Phi-3 slices its fused [q|k|v] at
``config.num_attention_heads * head_dim``, StableLM and Bloom ``view(..., self.num_heads, ...)``,
GPT-2 ``split(self.split_size)``. On a rank holding 1/tp of the heads that code crashes or, worse,
runs with heads folded into another dimension. This style does what PrepareModuleInput does and
also divides the named integer attributes by the mesh size -- on the module itself, or on a
private copy of an object it holds such as its ``config`` (shared by every layer and the rest of
the model, so never changed in place). The plan names attributes, not values, so one plan fits
a model of any width (planned at full size, checked on a small copy); each attribute must exist,
be an int and divide evenly, or nothing is applied.

``attribute_divisors`` divides some of them by another number than the mesh size: with grouped-query
attention whose KV heads are fewer than the ranks (KVReplicatedParallel's ``kv_heads``), each rank
keeps one KV head and its query heads, so the query heads per KV head (``num_key_value_groups``)
shrink by ``size / kv_heads`` and a KV head count by ``kv_heads``.

``head_count`` is for heads the mesh size does not divide (HeadRowsParallel / HeadColsParallel,
hyper_parallel/core/tensor_parallel/uneven_heads.py): rank r keeps the whole heads
``[r*H//size, (r+1)*H//size)`` of ``H = head_count``, so each named attribute (a count or a width
that is a multiple of H) becomes its share of those heads -- 25 heads, split size 1600 at tp=4:
6 heads and 384 on ranks 0-2, 7 and 448 on rank 3.

``folded_heads`` names the attribute holding the global head count when the module also receives
per-head tensors with the heads folded into the batch dimension (Bloom's ALiBi bias, built once
by the model as ``(batch * heads, 1, seq)`` and passed to every layer): any tensor input after
the first -- positional or keyword -- whose leading dimension is ``batch * heads`` (batch: the
first input's) keeps only this rank's heads' rows; so does one whose leading dimension is the head
count itself (MPT's ALiBi bias, ``(heads, 1, seq)``). Such inputs are built from the sequence, not
learned, so the slice needs no gradient of its own; DTensor inputs are left to the layouts.

``head_params`` names parameters the module holds itself with one row per head (GPT-OSS's learnable
attention sinks, ``sinks`` of shape ``(heads,)``, one extra logit per head concatenated to its
scores): each becomes a ``Shard(0)`` DTensor over the mesh -- its gradient is whole per head, so
nothing is reduced -- and the module's own code sees this rank's rows as a plain tensor during
forward (``torch.nn.utils.stateless``: autograd flows back to the sharded parameter), as it sees
its heads' columns of q, k and v.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils.stateless import _reparametrize_module

from hyper_parallel.core.tensor_parallel.base import ApplyRecord, check_divides, shard_params
from hyper_parallel.core.tensor_parallel.prepare_styles import PrepareModuleInput
from hyper_parallel.core.tensor_parallel.uneven_heads import head_bounds
from hyper_parallel.errors import LayoutError, StyleSpecError


def _owner(module: nn.Module, path: str):
    """(object holding the attribute, attribute name) for ``path`` ("num_heads", "config.num_attention_heads")."""
    *hops, name = path.split(".")
    obj = module
    for hop in hops:
        obj = getattr(obj, hop, None)
        if obj is None:
            return None, name
    return obj, name


def check_local_attributes(module: nn.Module, paths: list[str], divisors: dict[str, int] | None, mesh: DeviceMesh,
                           where: str, head_count: int | None = None) -> None:
    """Each path names an int attribute of ``module`` (or of an object it holds, not a submodule)
    that its divisor -- the mesh size unless ``divisors`` names another -- divides; with
    ``head_count`` (whole heads split unevenly) a multiple of it, with at least one head per rank."""
    for path in paths:
        obj, name = _owner(module, path)
        if obj is None or not hasattr(obj, name):
            raise LayoutError(f"{where}: {type(module).__name__} has no attribute {path!r}")
        if isinstance(obj, nn.Module) and obj is not module:
            raise LayoutError(f"{where}: {path!r} goes through a submodule; name it on that module")
        value = getattr(obj, name)
        if type(value) is not int:
            raise LayoutError(f"{where}: {path} is {value!r}, not an int")
        d = (divisors or {}).get(path)
        if head_count is not None:
            if value % head_count or head_count < mesh.size():
                raise LayoutError(f"{where}: {path} = {value} is not a multiple of head_count={head_count}, "
                                  f"or the heads are fewer than the mesh size {mesh.size()}")
        elif d is None:
            check_divides(value, mesh, where, path)
        elif value % d:
            raise LayoutError(f"{where}: {path} = {value} is not divisible by its divisor {d}")


def set_local_attributes(module: nn.Module, paths: list[str], divisors: dict[str, int] | None, mesh: DeviceMesh,
                         record: ApplyRecord, head_count: int | None = None) -> None:
    """Divide each attribute ``paths`` names (checked by :func:`check_local_attributes`) by its
    divisor -- or, with ``head_count``, make it this rank's share of whole heads
    (uneven_heads.head_bounds) -- recording the old values; an object the path goes through
    (``config``) is copied for this module first, since the model's other modules share it."""
    size = mesh.size()
    copied: set[str] = set()
    for path in paths:
        hop = path.split(".")[0] if "." in path else ""
        if hop and hop not in copied:   # a private copy: the original is shared with other modules
            record.set_attr(module, hop, copy.copy(getattr(module, hop)))
            copied.add(hop)
        obj, name = _owner(module, path)
        value = getattr(obj, name)
        if head_count is not None:
            lo, hi = head_bounds(head_count, size, mesh.get_local_rank())
            record.set_attr(obj, name, value // head_count * (hi - lo))
        else:
            record.set_attr(obj, name, value // ((divisors or {}).get(path) or size))


def check_attribute_paths(paths, where: str) -> list[str]:
    """``paths`` as a sorted list of attribute paths ('name' or 'object.name'), or a StyleSpecError."""
    if not isinstance(paths, (list, tuple)) or not paths:
        raise StyleSpecError(f"{where}: local_attributes must be a non-empty list of attribute paths, got {paths!r}")
    for path in paths:
        if not isinstance(path, str) or path.count(".") > 1 or not all(part.isidentifier() for part in path.split(".")):
            raise StyleSpecError(f"{where}: local_attributes entry {path!r} is not an attribute path "
                                 f"('name' or 'object.name')")
    return sorted(set(paths))


def _check_head_params(names, where: str) -> list[str]:
    if names is None:
        return []
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n.isidentifier()
                                                                     for n in names):
        raise StyleSpecError(f"{where}: head_params must be a non-empty list of parameter names the module holds "
                             f"itself, got {names!r}")
    return sorted(set(names))


class PrepareHeadsInput(PrepareModuleInput):
    """PrepareModuleInput, plus ``local_attributes``: attribute paths whose integer values are
    divided by the mesh size on apply (restored by a rollback). A path is ``name`` or
    ``object.name`` through one non-module object (``config.num_attention_heads``), which is
    then copied for this module."""

    _args = {**PrepareModuleInput._args, "local_attributes": None, "folded_heads": None, "attribute_divisors": None,
             "head_count": None, "head_params": None}

    def __init__(self, *, local_attributes: list[str] | None = None, folded_heads: str | None = None,
                 attribute_divisors: dict[str, int] | None = None, head_count: int | None = None,
                 head_params: list[str] | None = None, **kwargs):
        super().__init__(**kwargs)
        where = type(self).__name__
        self.head_params = _check_head_params(head_params, where) or None
        if self.head_params and head_count is not None:
            raise StyleSpecError(f"{where}: head_params {self.head_params} are split evenly (Shard(0)); they do not "
                                 f"combine with head_count={head_count} (heads split unevenly)")
        if head_count is not None and (type(head_count) is not int or head_count < 1):
            raise StyleSpecError(f"{where}: head_count must be an int >= 1 (the heads split unevenly), got "
                                 f"{head_count!r}")
        if head_count is not None and (attribute_divisors or folded_heads):
            raise StyleSpecError(f"{where}: head_count (uneven whole heads) does not combine with "
                                 f"attribute_divisors or folded_heads")
        self.head_count = head_count
        divisors = dict(attribute_divisors or {})
        for path, d in divisors.items():
            if path not in (local_attributes or []) or type(d) is not int or d < 1:
                raise StyleSpecError(f"{where}: attribute_divisors entry {path!r}: {d!r} must name one of "
                                     f"local_attributes {local_attributes!r} with an int >= 1")
        self.attribute_divisors = divisors or None
        if folded_heads is not None and folded_heads not in (local_attributes or []):
            raise StyleSpecError(f"{where}: folded_heads={folded_heads!r} must be one of local_attributes "
                                 f"{local_attributes!r} (the head count the folded inputs are cut by)")
        self.folded_heads = folded_heads
        self.local_attributes = check_attribute_paths(local_attributes, where) \
            if local_attributes or not self.head_params else None

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        super().check_module(module, mesh, fqn)
        where = f"{type(self).__name__} on {fqn or '<root>'}"
        check_local_attributes(module, self.local_attributes or [], self.attribute_divisors, mesh, where,
                               self.head_count)
        for name in self.head_params or ():
            p = module._parameters.get(name)
            if not isinstance(p, nn.Parameter) or p.dim() < 1:
                raise LayoutError(f"{where}: head_params entry {name!r} is not a parameter {type(module).__name__} "
                                  f"holds itself with a head dimension first")
            check_divides(p.shape[0], mesh, where, f"the head rows of {name}")

    def param_shard_dims(self, params: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, bool]] | None:
        return {name: (0, False) for name in self.head_params or () if name in params} or None

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        set_local_attributes(module, self.local_attributes or [], self.attribute_divisors, mesh, record,
                             self.head_count)
        out = super().apply(module, mesh, record, fqn)
        if self.folded_heads is not None:   # runs after the layouts' hook: the first input is settled
            record.add_hook(module.register_forward_pre_hook(self._unfold(module, mesh), with_kwargs=True))
        if self.head_params:
            self._shard_head_params(module, mesh, record, fqn)
        return out

    def _shard_head_params(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str) -> None:
        """Each head parameter a Shard(0) DTensor; forward runs on its local rows."""
        shard_params(module, mesh, record, {n: Shard(0) for n in self.head_params}, Shard(0), fqn, only=True)
        names, inner = list(self.head_params), module.forward

        def forward(*args, **kwargs):
            # looked up per call: meta initialisation (to_empty) replaces the parameter objects
            rows = {n: p.to_local() if isinstance(p, DTensor) else p
                    for n in names if (p := module._parameters[n]) is not None}
            with _reparametrize_module(module, rows):
                return inner(*args, **kwargs)

        record.set_attr(module, "forward", forward)

    def _unfold(self, module: nn.Module, mesh: DeviceMesh):
        obj, name = _owner(module, self.folded_heads)
        size, rank = mesh.size(), mesh.get_local_rank()

        def cut(x, batch: int):
            local = getattr(obj, name)      # already the local count
            heads = local * size
            if not isinstance(x, torch.Tensor) or isinstance(x, DTensor) or x.dim() == 0:
                return x
            if x.shape[0] == heads and batch != 1:   # one row per head, not folded (MPT's ALiBi bias)
                return x[rank * local:(rank + 1) * local]
            if x.shape[0] != batch * heads:
                return x
            rows = x.reshape(batch, heads, *x.shape[1:])[:, rank * local:(rank + 1) * local]
            return rows.reshape(batch * local, *x.shape[1:])

        def hook(mod, args, kwargs):
            if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() == 0:
                return None
            batch = args[0].shape[0]
            return (args[0], *(cut(a, batch) for a in args[1:])), {k: cut(v, batch) for k, v in kwargs.items()}
        return hook

