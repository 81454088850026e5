"""A model run with a block list shortened to representative blocks, then put back as it was.

Capture (one block per group) and the stage split's trace (a long stack through its first block)
both run a model whose stack is shorter than it is. Two things must follow the shortening and be
undone after it: the stack's config count (transformers resolves hidden-state indices counted
from the end by ``num_hidden_layers``: LLaVA's ``vision_feature_layer=-2``), and the output
recorders transformers 5 installs on a model's first forward, on the layers present then, marking
the model so it never installs them again -- left in place, every later run of the same model
object would record the wrong layers (LLaVA's ``hidden_states[-2]`` is None).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch.nn as nn

_FLAG = "_output_capturing_hooks_installed"   # transformers' mark on a model whose recorders are in


def _hook_state(model: nn.Module) -> dict[int, tuple]:
    """Every module's forward hooks and transformers' "recorders installed" mark."""
    return {id(m): (set(m._forward_hooks), set(m._forward_pre_hooks), m.__dict__.get(_FLAG)) for m in model.modules()}


def _restore_hooks(model: nn.Module, state: dict[int, tuple]) -> None:
    """Remove the hooks added since ``state`` was taken and put the marks back as they were."""
    for m in model.modules():
        fwd, pre, flag = state.get(id(m), (set(), set(), None))
        for key in set(m._forward_hooks) - fwd:
            del m._forward_hooks[key]
            m._forward_hooks_with_kwargs.pop(key, None)
            m._forward_hooks_always_called.pop(key, None)
        for key in set(m._forward_pre_hooks) - pre:
            del m._forward_pre_hooks[key]
            m._forward_pre_hooks_with_kwargs.pop(key, None)
        if flag is None:
            m.__dict__.pop(_FLAG, None)
        else:
            m.__dict__[_FLAG] = flag


@contextlib.contextmanager
def short_stacks(model: nn.Module, shorts: dict[str, nn.Module]) -> Iterator[None]:
    """Run with each block list ``prefix`` of ``model`` replaced by ``shorts[prefix]``; the config
    of its parent says the shortened count meanwhile; the lists, counts and hooks are restored."""
    restore: list[tuple[nn.Module, str, nn.Module]] = []
    configs: list[tuple[object, int]] = []
    hooks = _hook_state(model)
    try:
        for prefix, short in shorts.items():
            container = model.get_submodule(prefix)
            parent_name, _, attr = prefix.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            restore.append((parent, attr, container))
            setattr(parent, attr, short)
            config = getattr(parent, "config", None)
            if getattr(config, "num_hidden_layers", None) == len(container) and not isinstance(config, nn.Module):
                configs.append((config, config.num_hidden_layers))
                config.num_hidden_layers = len(short)
        yield
    finally:
        for config, count in reversed(configs):
            config.num_hidden_layers = count
        for parent, attr, container in reversed(restore):
            setattr(parent, attr, container)
        _restore_hooks(model, hooks)
