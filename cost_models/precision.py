"""What a Linear's float8 training costs and saves, term by term, each from what the runtime runs.

The runtime is torchao's ``Float8Linear`` (``hyper_parallel.core.float8``). Per Linear and step,
for T tokens through an (in K, out N) weight on one rank:

- GEMMs: the three GEMMs (output, input gradient, weight gradient), 2*T*K*N FLOPs each, run at
  the profile's dense float8 peak (``peak_flops.fp8``, a datasheet figure) instead of the bf16 one,
  at the same shape efficiency (:func:`cost_models.compute.gemm_efficiency`: the curve is the
  GEMM's tiling, not its element type -- an assumption until a kernel profile measures float8
  GEMMs, which then anchors it the same way).
- Casts: torchao's ``matmul_with_hp_or_float8_args`` casts six operands per step: input and weight
  for the output GEMM, gradient and weight for the input gradient, gradient and input for the weight
  gradient (``float8_linear.py``: each ``hp_tensor_to_float8_dynamic``). Each cast reads the high
  precision tensor once for its amax and once to scale it, and writes one byte per element: 2 + 2 + 1
  bytes per element at bf16, memory-bound at the profile's HBM bandwidth and efficiency.
- Float8 all-gather: FSDP2 gathers a tensorwise weight in one byte per element instead of two
  (torchao's ``fsdp_pre_all_gather``); the scales cost one all-reduce of one float per weight.
- Memory: the gathered (unsharded) weight is held in float8 under that all-gather: one byte per
  element less while a block is gathered. Activations saved for backward stay in high precision
  (torchao saves ``input_hp``), so nothing else changes.

A profile without ``peak_flops.fp8`` (A100, Ascend, a CPU) prices nothing in float8: it has no
float8 GEMM, and float8 is never chosen there.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.compute import gemm_efficiency
from cost_models.hardware.profile import HardwareProfile

CASTS_PER_STEP = 6                 # operands torchao casts per Linear per step (see the module doc)
CAST_BYTES_PER_ELEMENT = 2 + 2 + 1  # amax read, scaling read, float8 write (bf16 in, float8 out)
RECIPE_PEAK = {"tensorwise": "fp8", "rowwise": "fp8", "mxfp8": "mxfp8"}


def float8_peak(hardware: HardwareProfile, recipe: str = "tensorwise") -> float | None:
    """The profile's dense peak for ``recipe``'s GEMMs, or None where it has no such GEMM."""
    return hardware.peak_flops.get(RECIPE_PEAK.get(recipe, "fp8"))


@dataclass(frozen=True)
class LinearPrecisionCost:
    """One Linear on one rank, per step, in seconds: its three GEMMs in bf16 and in float8, and the
    casts float8 adds."""

    gemm_bf16_s: float
    gemm_float8_s: float
    cast_s: float

    @property
    def float8_s(self) -> float:
        return self.gemm_float8_s + self.cast_s

    @property
    def saving_s(self) -> float:
        """bf16 minus float8: positive where float8 pays."""
        return self.gemm_bf16_s - self.float8_s


def linear_cost(hardware: HardwareProfile, tokens: float, k: float, n: float,
                recipe: str = "tensorwise") -> LinearPrecisionCost | None:
    """The cost of one Linear of (K in, N out) over ``tokens`` rows on one rank, per step (the
    dimensions a rank sees: a tensor-parallel shard's K or N); None where the hardware has no float8."""
    peak8 = float8_peak(hardware, recipe)
    if not peak8:
        return None
    flops = 3 * 2.0 * tokens * k * n
    eff = gemm_efficiency(hardware, tokens, n, k)
    bf16 = flops / (hardware.peak("bf16") * eff)
    fp8 = flops / (peak8 * eff)
    elements = 2 * (tokens * k) + 2 * (k * n) + 2 * (tokens * n)   # the six casts' operands
    cast = CAST_BYTES_PER_ELEMENT * elements / (hardware.memory_bandwidth * hardware.efficiency.memory)
    return LinearPrecisionCost(bf16, fp8, cast)


def float8_gather_saving_bytes(k: float, n: float, dp: int) -> float:
    """Bytes one rank receives less per FSDP all-gather of a (K, N) weight gathered in float8
    rather than bf16 over ``dp`` ranks: one byte per element of the (dp - 1)/dp it receives."""
    return k * n * (dp - 1) / dp if dp > 1 else 0.0
