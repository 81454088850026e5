"""FSDP2's warning about a wrapped module that returns a view, silenced where the caller only reads.

FSDP2 registers its pre-backward hook (the all-gather a resharded module needs before its
backward) on the wrapped module's outputs and warns when an output is a view: an in-place op on
a view would drop the hook. Tensor-parallel outputs are often views (``DTensor.to_local`` is one),
so a model's root returning its logits, or a pipeline stage returning its boundary activation,
warns on every plan with FSDP. Their consumers here -- the loss, the pipeline's send and its
backward -- only read them. :func:`read_only_output` silences that one warning for that one
module class; a block inside the model whose view output the model's own code could modify in
place still warns.

A filter added to ``warnings.filters`` once, not ``warnings.catch_warnings`` around each call:
changing the filters resets Python's once-per-location registry, so a per-step context would make
every other "once" warning (DTensor's, transformers') repeat on every step.
"""
from __future__ import annotations

import re
import warnings

import torch.nn as nn


def read_only_output(module: nn.Module) -> None:
    """Say that ``module``'s caller never modifies its output in place: FSDP2's view-output
    warning for its class is filtered from now on (added once; a no-op when already there)."""
    pattern = rf"FSDP2-wrapped module \({re.escape(type(module).__name__)}\) returned a view"
    if any(f[0] == "ignore" and f[1] is not None and f[1].pattern == pattern for f in warnings.filters):
        return
    warnings.filterwarnings("ignore", message=pattern, category=UserWarning)
