"""Float8 training: torchao's float8 Linears composed with hyper_parallel's parallelisms.

- ``recipes``: the recipes (tensorwise, rowwise, mxfp8), where each runs natively, emulation elsewhere
- ``convert``: ``convert_to_float8`` -- chosen Linears swapped before the parallel styles apply
- ``fsdp``: ``scale_before_gather`` -- FSDP2's float8 all-gather with scales from the whole mesh;
  ``high_precision_state`` -- those weights as plain tensors, for checkpoints and exports
- ``errors``: typed refusals; ``quiet``: torchao imported without its CPU-only noise

See docs/float8.md.

Importing this package installs the log filter of ``quiet`` (and nothing else): transformers
imports torchao by itself when it is installed, so a filter installed later, when float8 is first
used, would come after the lines it is for.
"""
from hyper_parallel.core.float8.convert import (
    Float8Conversion,
    convert_to_float8,
    float8_linears,
    float8_shape_problem,
    float8_summary,
)
from hyper_parallel.core.float8.errors import Float8Error, Float8HardwareError, Float8ShapeError
from hyper_parallel.core.float8.fsdp import float8_gathered, high_precision, high_precision_state, scale_before_gather
from hyper_parallel.core.float8.quiet import quiet_torchao_import
from hyper_parallel.core.float8.recipes import RECIPES, native_float8, resolve_emulate

__all__ = ["Float8Conversion", "Float8Error", "Float8HardwareError", "Float8ShapeError", "RECIPES",
           "convert_to_float8", "float8_gathered", "float8_linears", "float8_shape_problem", "float8_summary",
           "high_precision", "high_precision_state", "native_float8", "quiet_torchao_import",
           "resolve_emulate", "scale_before_gather"]

quiet_torchao_import()
