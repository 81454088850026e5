"""Importing torchao quietly: drop the two known-harmless log lines it makes on a machine without
CUDA, and nothing else.

torchao 0.18 loads its compiled extensions at import; two of them (``_C_mxfp8``,
``_C_cutlass_90a``) are CUDA kernels that cannot load on a CPU build of torch, and it logs a
warning for each; without triton, ``torchao.kernel.intmm`` warns that its int8 kernels will not
work (float8 training does not use them). torch's pytree logs a deprecation warning when torchao registers its
``KernelPreference`` enum. Neither says anything about float8 training on this machine (the
emulated GEMMs need neither), so both are filtered -- by exact message, on their own loggers, and
the extension and triton lines only where CUDA is absent (on a GPU a failed extension is a real problem and
keeps its warning). A float8-gathered weight's scale under FSDP beside tensor parallel is a max
over a 2-D mesh, which DTensor reduces in two all-reduces and warns that their order may give
ranks different results: true of a sum, never of a max (exact in any order), so that warning is
dropped for redistributions from ``Partial(max)`` placements only. Every other line those
loggers write passes through.
"""
from __future__ import annotations

import logging
import re

import torch

_CUDA_EXTENSION = re.compile(r"Failed to load .*torchao[/\\]_C_(mxfp8|cutlass_90a)\S*\.so")
_ENUM_PYTREE = "is an Enum subclass and is now natively supported"
_NO_TRITON = "Detected no triton"      # torchao.kernel.intmm: int8 kernels float8 training never calls
_MAX_IN_STEPS = re.compile(r"While redistributing from \((Partial\(max\)(, )?)+\) to .* sequential all_reduce")
_REDISTRIBUTE = "torch.distributed.tensor._redistribute"


class _KnownHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _ENUM_PYTREE in message or _MAX_IN_STEPS.search(message):
            return False
        cpu_only = not torch.cuda.is_available()
        return not (cpu_only and (_CUDA_EXTENSION.search(message) or _NO_TRITON in message))


_FILTER = _KnownHarmless()


def quiet_torchao_import() -> None:
    """Install the filter on torchao's and torch pytree's loggers (idempotent). Call before the
    first ``import torchao`` of the process (transformers imports it too when it is installed)."""
    for name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree", _REDISTRIBUTE):
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
