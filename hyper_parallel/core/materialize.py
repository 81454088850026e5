"""Meta first: give a model built on the meta device real, plan-independent initial weights.

A model larger than one device is built on ``meta`` (no memory), parallelized there (tensor
parallel, pipeline stages, FSDP: the parameters become meta DTensors or meta shards), and only
then made real -- each rank allocating only what it holds. The difficulty is the values: a
model's own init (``reset_parameters``, transformers' ``_init_weights``, torchtitan's
``init_weights``) draws from one random stream over the whole model, so what a shard gets would
depend on which other parameters this rank holds and in which order it meets them. Here the
value of every parameter is defined one module at a time:

- the module that *owns* a parameter (for tied weights: the first owner in the original model's
  order) is initialised by ``init_fn(module)`` on a full-size stand-in of its own parameters and
  buffers (its children left out), with torch's random generator seeded from ``(seed, the owner's
  fully-qualified name)``;
- each rank copies its slice of that full tensor into the parameter it holds (a DTensor's local
  shard, as ``distribute_tensor`` would cut it; a plain tensor whole).

So the initial weights are a function of the seed and the model alone: one device, tp=4, FSDP x
TP and a pipeline all hold slices of the same tensors. A rank computes one module's full tensors
at a time (peak extra memory: the largest module's parameters), generated on ``init_device`` (the
CPU by default, so the values do not depend on the accelerator either).

Buffers follow the same rule. Non-persistent buffers a constructor computes (RoPE tables) are
meta after a meta build; the init function must compute them (transformers 5 does in
``_init_weights``; the repo Llama in ``init_module``). A floating buffer the init function left
untouched is an error naming it, never silent garbage.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable, Collection

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hyper_parallel.core.dtensor.blocks import holds_one_block
from hyper_parallel.errors import InitError

log = logging.getLogger(__name__)

InitFn = Callable[[nn.Module], None]


def module_seed(seed: int, fqn: str) -> int:
    """The random seed of the module at ``fqn``: stable across processes and Python runs."""
    digest = hashlib.sha256(f"{int(seed)}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class InitSources:
    """Where each tensor of a model gets its initial value, read from the model before any
    parallelism changes it: every parameter and buffer name (tied aliases included) -> (owner
    module's name, attribute), and the owner modules themselves (their class and configuration
    define the init; they may be meta)."""

    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)
    owners: dict[str, nn.Module] = field(default_factory=dict)
    classes: dict[str, type] = field(default_factory=dict)      # owner -> its class when read
    kinds: dict[str, str] = field(default_factory=dict)          # owner/attr -> "param" | "buffer"

    @classmethod
    def of(cls, model: nn.Module) -> "InitSources":
        out = cls()
        first: dict[int, tuple[str, str]] = {}
        for mod_name, module in model.named_modules(remove_duplicate=False):
            for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
                for attr, t in table.items():
                    if t is None:
                        continue
                    name = f"{mod_name}.{attr}" if mod_name else attr
                    src = first.setdefault(id(t), (mod_name, attr))
                    out.tensors.setdefault(name, src)
                    if src == (mod_name, attr):
                        out.owners.setdefault(mod_name, module)
                        out.classes.setdefault(mod_name, type(module))
                        out.kinds[f"{mod_name}/{attr}"] = kind
        return out


def _meta_shadow(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s subtree whose tensors are on meta: an init function that reaches into
    children (CLIP's initialises its embeddings' patch projection with the class token) writes
    nothing there, and leaves the real children untouched."""
    shadow = object.__new__(type(module))
    shadow.__dict__.update(module.__dict__)
    shadow._parameters = {a: None if t is None else nn.Parameter(torch.empty(tuple(t.shape), dtype=t.dtype,
                                                                              device="meta"), t.requires_grad)
                          for a, t in module._parameters.items()}
    shadow._buffers = {a: None if t is None else torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
                       for a, t in module._buffers.items()}
    shadow._modules = {a: None if c is None else _meta_shadow(c) for a, c in module._modules.items()}
    return shadow


def _stand_in(module: nn.Module, cls: type, device: torch.device) -> nn.Module:
    """A shallow copy of ``module`` with full-size, empty tensors of its own on ``device`` (None
    entries kept: ``bias=None`` is read by inits) and its children as meta copies
    (:func:`_meta_shadow`), so ``init_fn`` writes nothing but the stand-in's own tensors.
    Floating tensors start NaN, so a tensor the init function leaves untouched is seen. ``cls``:
    the module's class before any parallelism (FSDP2 swaps in a subclass whose construction is
    not a copy)."""
    shadow = object.__new__(cls)
    shadow.__dict__.update(module.__dict__)
    shadow._parameters, shadow._buffers = {}, {}
    shadow._modules = {a: None if c is None else _meta_shadow(c) for a, c in module._modules.items()}
    for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
        for attr, src in table.items():
            full = None
            if src is not None:
                full = torch.empty(tuple(src.shape), dtype=src.dtype, device=device)
                if full.is_floating_point():
                    full.fill_(float("nan"))
            if kind == "param":
                shadow._parameters[attr] = None if full is None else nn.Parameter(full, requires_grad=src.requires_grad)
            else:
                shadow._buffers[attr] = full
    return shadow


def local_slice(full: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` as ``held`` lays it out (no communication). Plain shards are
    a view of ``full`` (no copy: a copy of the shard would sit beside the full tensor at the peak);
    other placements (a packed projection's strided shard) are cut by ``distribute_tensor`` on the
    held tensor's device."""
    if not isinstance(held, DTensor):
        return full
    if holds_one_block(held.placements):
        shape, offset = compute_local_shape_and_global_offset(full.shape, held.device_mesh, held.placements)
        view = full
        for dim, (n, o) in enumerate(zip(shape, offset)):
            view = view.narrow(dim, o, n)
        return view
    return distribute_tensor(full.to(held.device), held.device_mesh, held.placements, src_data_rank=None).to_local()


class Materializer:
    """Computes each tensor's initial value owner by owner and copies this rank's slice of it into
    the tensors given to :meth:`fill` (named as in the original model, e.g. a pipeline rank's
    stage units; a name ``sources`` does not know is an error)."""

    def __init__(self, sources: InitSources, init_fn: InitFn, *, seed: int = 0,
                 init_device: str | torch.device = "cpu"):
        self.sources = sources
        self.init_fn = init_fn
        self.seed = int(seed)
        self.init_device = torch.device(init_device)
        self._cache: tuple[str, dict[str, torch.Tensor]] | None = None

    def owner_values(self, owner: str) -> dict[str, torch.Tensor]:
        """Full initial tensors of ``owner``'s own parameters and buffers (the last owner is kept:
        its tensors are usually read one after another)."""
        if self._cache is not None and self._cache[0] == owner:
            return self._cache[1]
        self._cache = None   # the last owner's tensors go before this one's are made (peak: one module)
        module = self.sources.owners[owner]
        attrs = [(kind, a) for kind, table in (("param", module._parameters), ("buffer", module._buffers))
                 for a, t in table.items() if t is not None and f"{owner}/{a}" in self.sources.kinds]
        shadow = _stand_in(module, self.sources.classes[owner], self.init_device)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, owner))
            self.init_fn(shadow)
        values = {}
        for kind, attr in attrs:
            t = shadow._parameters[attr] if kind == "param" else shadow._buffers[attr]
            t = t.detach()
            sample = t.reshape(-1)[:: max(1, t.numel() // 4096)]   # no full-size temporary
            if t.is_floating_point() and t.numel() and bool(torch.isnan(sample).all()):
                raise InitError(f"materialize: the init function left {kind} {attr!r} of module "
                                f"{owner or '<root>'!r} ({type(module).__name__}) unset; give an init_fn that "
                                "initialises it (or build that module's tensors off the meta device)")
            values[attr] = t
        self._cache = (owner, values)
        return values

    def initial(self, name: str) -> torch.Tensor:
        """The full initial value of the tensor ``name`` (any alias of a tied tensor)."""
        if name not in self.sources.tensors:
            raise InitError(f"materialize: {name!r} is not a parameter or buffer of the model the plan was "
                            "applied to; materialize the modules of that model")
        owner, attr = self.sources.tensors[name]
        return self.owner_values(owner)[attr]

    def fill(self, named: dict[str, torch.Tensor]) -> None:
        """Copy each tensor's initial value (its slice of it) into ``named`` (name -> real tensor),
        owner by owner so each module's init runs once -- the owners with the largest tensors first:
        ``to_empty`` leaves pages untouched, so a large stand-in (an embedding) sits beside few
        written shards rather than beside all of them."""
        def size(name: str) -> int:
            owner = self.sources.owners.get(self.sources.tensors.get(name, ("", ""))[0])
            return -sum(t.numel() * t.element_size() for t in owner._parameters.values() if t is not None) \
                if owner is not None else 0
        order = sorted(named, key=lambda n: (size(n), self.sources.tensors.get(n, ("", n))))
        with torch.no_grad():
            for name in order:
                held = named[name]
                value = self.initial(name)
                local = local_slice(value, held)   # a view on the init device; copy_ moves only the slice
                target = held.to_local() if isinstance(held, DTensor) else held
                if tuple(target.shape) != tuple(local.shape):
                    raise InitError(f"materialize: {name!r} holds a local shape {tuple(target.shape)} but its "
                                    f"placements cut {tuple(local.shape)} from the full {tuple(value.shape)}")
                target.copy_(local)
                del value, local, target   # this owner's full tensors must not outlive the cache


def named_tensors(root: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under ``root`` by name, tied ones under each of their names."""
    out = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for table in (module._parameters, module._buffers):
            for attr, t in table.items():
                if t is not None:
                    out[f"{mod_name}.{attr}" if mod_name else attr] = t
    return out


def _to_empty_in_place(root: nn.Module, device: torch.device) -> None:
    """``root.to_empty(device)`` that keeps every tensor object (``swap_tensors``): an optimizer,
    ZeRO-1, a tied alias or a pipeline stage that references a tensor made before materialising
    still holds the real one afterwards. Parameters are swapped by ``Module._apply`` under the
    swap flag (plain meta parameters would otherwise become new Parameters, one per module);
    buffers ``_apply`` always replaces in each module's table, so each new buffer is swapped into
    the original object and put back wherever it was registered."""
    buffers: dict[int, tuple[torch.Tensor, list[tuple[dict, str]]]] = {}
    for _, module in root.named_modules(remove_duplicate=False):
        for attr, t in module._buffers.items():
            if t is not None:
                buffers.setdefault(id(t), (t, []))[1].append((module._buffers, attr))
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        root.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    for original, places in buffers.values():
        table, attr = places[0]
        if table[attr] is not original:
            torch.utils.swap_tensors(original, table[attr])
        for table, attr in places:
            table[attr] = original


def materialize(root: nn.Module, sources: InitSources, init_fn: InitFn, *, device: str | torch.device,
                seed: int = 0, init_device: str | torch.device = "cpu", skip: Collection[str] = ()) -> nn.Module:
    """Allocate ``root``'s tensors on ``device`` (``to_empty``, in place: FSDP2 keeps its sharded
    views) and give each its plan-independent initial value -- except the tensors named in
    ``skip``, left allocated for the caller to fill (a pretrained load). ``root`` names its
    modules as the original model did (``sources`` was read from it before parallelizing)."""
    device = torch.device(device)
    _to_empty_in_place(root, device)
    tensors = {}
    seen: set[int] = set()
    for name, t in named_tensors(root).items():
        if id(t) not in seen:   # a tied tensor is filled once, through its first name
            seen.add(id(t))
            if name not in skip:
                tensors[name] = t
    Materializer(sources, init_fn, seed=seed, init_device=init_device).fill(tensors)
    log.debug("materialized %d tensors on %s (seed %d)", len(tensors), device, seed)
    return root


def default_init_fn(model: nn.Module) -> InitFn:
    """The model's own per-module init: ``model.init_module(module)`` when the model defines it;
    else transformers' ``_init_weights`` of the module's nearest pretrained model (by module
    type: the stand-in is a copy); else each module's ``reset_parameters``. A module with tensors
    and none of these is an error naming it."""
    if hasattr(model, "init_module"):
        return model.init_module
    nearest: dict[type, nn.Module] = {}
    owners = {n: m for n, m in model.named_modules() if hasattr(m, "_init_weights") and hasattr(m, "config")}
    for name, module in model.named_modules():
        prefix = name
        while prefix not in owners and prefix:
            prefix = prefix.rpartition(".")[0]
        if prefix in owners:
            nearest.setdefault(type(module), owners[prefix])

    def init(module: nn.Module) -> None:
        owner = nearest.get(type(module))
        if owner is not None:
            owner._init_weights(module)
            return
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if reset is None:
            if module._parameters or module._buffers:
                raise InitError(f"materialize: {type(module).__name__} has tensors "
                                f"{sorted(list(module._parameters) + list(module._buffers))} and no reset_parameters; "
                                "pass init_fn=<function that initialises one module's own tensors>")
            return
        reset()

    return init
