"""Export a hyper_parallel plan as torch.distributed.tensor.parallel styles.

For users who want to hand a plan to plain torch (or compare with it): each of our styles maps
to the torch style with the same arguments. Two differences are resolved here, not hidden:
RowwiseParallel's default input on an nn.Embedding (we default token ids to Replicate, torch to
Shard(-1)) is written out explicitly, and NoParallel, which torch lacks, becomes a
PrepareModuleInputOutput that computes on local replicas -- the same numbers, with plain
rather than DTensor parameters.
"""
from __future__ import annotations

import torch.nn as nn
import torch.distributed.tensor.parallel as tp
from torch.distributed.tensor import Replicate

from hyper_parallel.core.tensor_parallel.base import ParallelStyle
from hyper_parallel.core.tensor_parallel.head_styles import PrepareHeadsInput
from hyper_parallel.core.tensor_parallel.latent_styles import PrepareLatentInput
from hyper_parallel.core.tensor_parallel.linear_styles import ColwiseParallel, RowwiseParallel
from hyper_parallel.core.tensor_parallel.parallelize import flatten_plan, match_modules
from hyper_parallel.core.tensor_parallel.prepare_styles import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
from hyper_parallel.core.tensor_parallel.replicate_styles import NoParallel, SequenceParallel
from hyper_parallel.errors import StyleSpecError


def to_torch_style(style: ParallelStyle, module: nn.Module | None = None) -> tp.ParallelStyle:
    """The torch style equivalent to ``style`` (``module`` resolves module-dependent defaults)."""
    if isinstance(style, ColwiseParallel) and style.packed > 1:
        raise StyleSpecError(f"no torch equivalent for {style!r}: torch's ColwiseParallel shards packed "
                             f"projections as one contiguous block")
    if isinstance(style, RowwiseParallel) and style.owned_output:
        raise StyleSpecError(f"no torch equivalent for {style!r}: torch's RowwiseParallel returns DTensor's local "
                             f"view, which the module's caller may not modify in place")
    if isinstance(style, PrepareHeadsInput):
        raise StyleSpecError(f"no torch equivalent for {style!r}: torch's styles do not set a module's head "
                             f"counts to their local values")
    if isinstance(style, PrepareLatentInput):
        raise StyleSpecError(f"no torch equivalent for {style!r}: torch's styles do not all-reduce the gradient of "
                             f"the columns a latent attention broadcasts to every head")
    if isinstance(style, (ColwiseParallel, RowwiseParallel)):
        cls = tp.ColwiseParallel if isinstance(style, ColwiseParallel) else tp.RowwiseParallel
        inp = style.input_layouts
        if inp is None and isinstance(style, RowwiseParallel) and isinstance(module, nn.Embedding):
            inp = Replicate()
        return cls(input_layouts=inp, output_layouts=style.output_layouts, use_local_output=style.use_local_output)
    if isinstance(style, SequenceParallel):  # reduce_grads=True: same numbers, torch reduces in the optimizer
        return tp.SequenceParallel(sequence_dim=style.sequence_dim, use_local_output=style.use_local_output)
    if isinstance(style, PrepareModuleInputOutput):
        return tp.PrepareModuleInputOutput(
            input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
            input_kwarg_layouts=style.input_kwarg_layouts,
            desired_input_kwarg_layouts=style.desired_input_kwarg_layouts, use_local_input=style.use_local_input,
            output_layouts=style.output_layouts, desired_output_layouts=style.desired_output_layouts,
            use_local_output=style.use_local_output)
    if isinstance(style, PrepareModuleInput):
        return tp.PrepareModuleInput(
            input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
            input_kwarg_layouts=style.input_kwarg_layouts,
            desired_input_kwarg_layouts=style.desired_input_kwarg_layouts, use_local_output=style.use_local_output)
    if isinstance(style, PrepareModuleOutput):
        return tp.PrepareModuleOutput(output_layouts=style.output_layouts,
                                      desired_output_layouts=style.desired_output_layouts,
                                      use_local_output=style.use_local_output)
    if isinstance(style, NoParallel):
        return tp.PrepareModuleInputOutput(
            input_layouts=(style.input_layouts,), desired_input_layouts=(style.desired_input_layouts,),
            use_local_input=True, output_layouts=(Replicate(),),
            desired_output_layouts=(style.output_layouts,), use_local_output=style.use_local_output)
    raise StyleSpecError(f"no torch equivalent for style {style!r}")


def to_torch_plan(plan, model: nn.Module | None = None) -> dict[str, tp.ParallelStyle]:
    """{pattern: torch style} for ``torch.distributed.tensor.parallel.parallelize_module``.

    With ``model``, module-dependent defaults are resolved from the first matching module.
    """
    out = {}
    for pattern, style in flatten_plan(plan).items():
        module = None
        if model is not None:
            matches = match_modules(model, pattern)
            module = matches[0][1] if matches else None
        out[pattern] = to_torch_style(style, module)
    return out
