"""Forward hooks a run leaves behind, undone.

transformers 5 installs its output recorders (hidden states, attentions) on a model's first forward,
on the layers present then, and marks the model so it never installs them again. A run of a model
with its block list shortened to one representative block (capture, the stage split's trace) would
leave recorders on that block only, and every later run of the same model object would record
the wrong layers (LLaVA's ``hidden_states[-2]`` is None). Such a run snapshots the hooks first and
restores them after.
"""
from __future__ import annotations

import torch.nn as nn

_FLAG = "_output_capturing_hooks_installed"   # transformers' mark on a model whose recorders are in


def hook_state(model: nn.Module) -> dict[int, tuple]:
    """Every module's forward hooks and transformers' "recorders installed" mark."""
    return {id(m): (set(m._forward_hooks), set(m._forward_pre_hooks), m.__dict__.get(_FLAG)) for m in model.modules()}


def restore_hooks(model: nn.Module, state: dict[int, tuple]) -> None:
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
