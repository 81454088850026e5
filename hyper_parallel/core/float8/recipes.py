"""The float8 recipes the runtime runs, and where each can run.

A recipe names how a Linear's three GEMMs (output, input gradient, weight gradient) are cast:

- ``tensorwise``: one scale per tensor, from its global amax (torchao's default; cuBLAS's
  tensorwise float8 GEMM on SM89/SM90+), rounded down to a power of two. The only recipe whose
  weights FSDP2 can all-gather in float8 (one scale per weight, computed before the gather).
- ``rowwise``: one scale per row of each GEMM operand, rounded down to a power of two (torchao's
  ``rowwise`` recipe; CUTLASS's rowwise kernel on SM90+).
- ``mxfp8``: a scale per block of 32 elements (OCP microscaling), a tensor-core format of SM100
  (Blackwell) only; torchao's ``MXFP8Linear``.

Where a GEMM has no float8 kernel (a CPU, an A100) the tensorwise and rowwise recipes run
*emulated*: the same casts and scales, the product of the dequantised operands in high precision
(``Float8LinearConfig(emulate=True)``). Emulation is what lets a CPU check that a parallel plan
computes the same float8 numbers as one device; it is never faster. MXFP8 has no emulation path
in the runtime: it is refused off Blackwell.

Scales are powers of two in both recipes (torchao's rowwise default; set here for tensorwise too).
Why: a sharded GEMM sums its partial products in another order than one device, so a tensor
differs from one device's in its last float32 bit. With an exact scale that difference moves the
amax, hence the scale, hence the rounding of *every* element of the next cast: measured on a
4-rank tensor-parallel Llama, losses drifted 2e-3 from one device within two steps. A scale
rounded down to a power of two does not move with the last bit and dequantises exactly, and the
same run stays within 1e-7 of one device for five steps (docs/float8.md). The cost is at most one
binade of float8's range at the top of each tensor.
"""
from __future__ import annotations

import dataclasses

import torch

from hyper_parallel.core.float8.errors import Float8Error, Float8HardwareError
from hyper_parallel.core.float8.quiet import quiet_torchao_import

RECIPES = ("tensorwise", "rowwise", "mxfp8")
# compute capability each recipe's float8 GEMM needs on CUDA (torch._scaled_mm / torchao's kernels)
MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0), "mxfp8": (10, 0)}
# the GEMM dimension multiple every float8 operand must have (torch._scaled_mm; MX blocks of 32)
DIM_MULTIPLE = {"tensorwise": 16, "rowwise": 16, "mxfp8": 32}


def check_recipe(recipe: str, where: str = "float8") -> str:
    if recipe not in RECIPES:
        raise Float8Error(f"{where}: recipe {recipe!r} is not a float8 recipe; valid: {list(RECIPES)}")
    return recipe


def native_float8(recipe: str, device: torch.device | str) -> bool:
    """Whether ``device`` runs ``recipe``'s float8 GEMMs natively (else they are emulated)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY[recipe]


def resolve_emulate(recipe: str, device: torch.device | str, emulate: bool | None) -> bool:
    """``emulate`` as given, or (None) emulate exactly where the device has no float8 GEMM.
    MXFP8 is refused where it would have to be emulated."""
    check_recipe(recipe)
    native = native_float8(recipe, device)
    if recipe == "mxfp8" and (emulate or not native):
        raise Float8HardwareError(f"float8 recipe 'mxfp8' on device {torch.device(device)}: MXFP8 GEMMs need a "
                                  f"Blackwell GPU (compute capability >= 10.0) and are not emulated; use "
                                  f"'tensorwise' or 'rowwise'")
    if emulate is None:
        return not native
    if not emulate and not native:
        raise Float8HardwareError(f"float8 recipe {recipe!r} with emulate=False on device {torch.device(device)}: "
                                  f"the device has no float8 GEMM for it (needs CUDA compute capability >= "
                                  f"{'.'.join(map(str, MIN_CAPABILITY[recipe]))}); pass emulate=None or True")
    return bool(emulate)


def linear_config(recipe: str, *, emulate: bool, fsdp_float8_all_gather: bool = False):
    """torchao's ``Float8LinearConfig`` for a tensorwise or rowwise recipe."""
    quiet_torchao_import()
    from torchao.float8 import Float8LinearConfig   # torchao on first use: planning never needs it

    check_recipe(recipe)
    if recipe == "mxfp8":
        raise Float8Error("linear_config: 'mxfp8' is not a Float8LinearConfig recipe (torchao's MXFP8Linear)")
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise Float8Error(f"float8 all-gather under FSDP with recipe {recipe!r}: only 'tensorwise' has one scale "
                          f"per weight to gather with; gather in high precision (fsdp_float8_all_gather=False)")
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather,
                               round_scales_to_power_of_2=True)
