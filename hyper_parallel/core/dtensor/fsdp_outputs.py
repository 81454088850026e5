"""FSDP2's warning about a wrapped module that returns a view, silenced where the caller only reads.

FSDP2 registers its pre-backward hook (the all-gather a resharded module needs before its
backward) on the wrapped module's outputs and warns when an output is a view: an in-place op on
a view would drop the hook. Tensor-parallel outputs are often views (``DTensor.to_local`` is one),
so a model's root returning its logits, or a pipeline stage returning its boundary activation,
warns on every plan with FSDP. Their consumers here -- the loss, the pipeline's send and its
backward -- only read them. :func:`read_only_output` silences that one warning for that one
module; a block inside the model whose view output the model's own code could modify in place
still warns.
"""
from __future__ import annotations

import re
import warnings
from contextlib import contextmanager

import torch.nn as nn


@contextmanager
def read_only_output(module: nn.Module):
    """Run ``module`` knowing its caller never modifies its output in place."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning,
                                message=rf"FSDP2-wrapped module \({re.escape(type(module).__name__)}\) returned a view")
        yield
