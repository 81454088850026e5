"""A parallelized model's weights: made real and initialised after a meta build, or loaded.

The large-model path builds the model on ``meta``, applies the plan there and only then gives
each rank real memory for what it holds (``hyper_parallel.core.materialize``): initial values
that do not depend on the plan, or a pretrained checkpoint read slice by slice
(:mod:`autoplan.plan.pretrained`). What those need to know about the original model -- which
module owns each tensor (tied weights), the model's own per-module init -- is read when the plan
is applied, before any parallelism changes the model (:class:`ModelInit`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from autoplan.plan.held import held_module
from autoplan.plan.hf_keys import KeyTarget, file_to_model_names
from hyper_parallel.core.materialize import InitFn, InitSources, default_init_fn, materialize, named_tensors
from hyper_parallel.errors import InitError


@dataclass
class ModelInit:
    """The original model's init facts, read at ``plan.apply`` time."""

    sources: InitSources
    init_fn: InitFn
    state_shapes: dict[str, tuple[int, ...]]   # the persistent tensors (state dict), model order
    config: object | None = None               # a transformers model's config (for an HF export)
    # a checkpoint file's key -> (the model's tensor name, its MergeSlot when transformers assembles
    # that tensor from several file tensors, else None): transformers renames keys on load (hf_keys)
    model_name: Callable[[str], KeyTarget] = staticmethod(lambda key: (key, None))

    @classmethod
    def of(cls, model: nn.Module) -> "ModelInit":
        shapes = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
        return cls(InitSources.of(model), default_init_fn(model), shapes, getattr(model, "config", None),
                   file_to_model_names(model))

    def file_name(self, name: str) -> str:
        """The name a tensor is stored under: its owner's (a tied alias is stored once)."""
        owner, attr = self.sources.tensors.get(name, ("", name))
        return f"{owner}.{attr}" if owner else attr

    def is_alias(self, name: str) -> bool:
        return self.file_name(name) != name


def held_tensors_on_meta(runner) -> list[str]:
    """Names of the tensors this rank trains that are still on the meta device."""
    out = [n for n, t in named_tensors(held_module(runner)).items() if t.device.type == "meta"]
    for group in runner.optimizer.param_groups:
        out += [f"<optimizer parameter {tuple(p.shape)}>" for p in group["params"] if p.device.type == "meta"]
    return out


def materialize_runner(runner, *, seed: int = 0, init_fn: InitFn | None = None,
                       init_device: str | torch.device = "cpu") -> None:
    """Allocate what this rank holds on its device and initialise it from ``seed`` with the
    model's own init (or ``init_fn(module)``, which initialises one module's own tensors); the
    full weights are the same under every plan and on one device (``build_model(seed=...)``)."""
    facts: ModelInit | None = getattr(runner, "model_init", None)
    if facts is None:
        raise InitError("materialize: this runner was not made by plan.apply (no record of the original model)")
    materialize(held_module(runner), facts.sources, init_fn or facts.init_fn, device=runner.device, seed=seed,
                init_device=init_device)
    left = held_tensors_on_meta(runner)
    if left:
        raise InitError(f"materialize: {len(left)} tensors are still on meta after materialising, e.g. {left[:3]}")
