"""Small models and a 'nothing changed' snapshot shared by the input-validation tests."""
from __future__ import annotations

import torch
import torch.nn as nn

from autoplan.models.llama import build_llama

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=128, ffn_hidden=128, max_seq_len=64)


def tiny_llama(device: str = "meta", **kw) -> nn.Module:
    return build_llama(device=device, **{**TINY, **kw})


def snapshot(model: nn.Module) -> tuple:
    """Parameter identities, hooks and buffers: equal before and after a refused call means the
    model was not touched."""
    params = tuple((n, id(p), type(p).__name__) for n, p in model.named_parameters(remove_duplicate=False))
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
                for m in model.modules())
    buffers = tuple((n, id(b)) for n, b in model.named_buffers())
    flags = tuple(sorted(k for m in model.modules() for k in vars(m) if k.startswith("_hp_")))
    return params, hooks, buffers, flags


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))
