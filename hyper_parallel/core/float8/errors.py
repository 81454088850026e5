"""Typed refusals of float8 training, each naming the module, the value and what would be valid."""
from __future__ import annotations

from hyper_parallel.errors import HyperParallelError


class Float8Error(HyperParallelError, ValueError):
    """Float8 was asked for where it cannot run: an unknown recipe, hardware without float8 GEMMs,
    a module that is not a Linear, or a shape the float8 GEMM cannot take."""


class Float8HardwareError(Float8Error):
    """The device (or the hardware profile a plan is for) has no float8 GEMM for the recipe."""


class Float8ShapeError(Float8Error):
    """A Linear whose dimensions the float8 GEMM cannot take (not multiples of 16)."""
