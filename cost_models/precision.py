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
  gradient (``float8_linear.py``: each ``hp_tensor_to_float8_dynamic``). Eager, each cast reads the
  high precision tensor once for its amax and once to scale it, and writes one byte per element:
  2 + 2 + 1 bytes per element at bf16, in two kernels; compiled, inductor computes the amax in the
  kernel that produced the tensor, so a cast is one read, one write and one kernel. Memory-bound at
  the profile's HBM bandwidth and efficiency.
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
# An eager cast is two passes (read for the amax, read again to scale, write float8) and two kernels;
# compiled, inductor folds the amax reduction into the kernel that produced the tensor (the norm or
# the previous GEMM's epilogue), leaving one read and one write and one kernel per cast.
CAST_PASSES = {False: 2, True: 1}
RECIPE_PEAK = {"tensorwise": "fp8", "rowwise": "fp8", "mxfp8": "mxfp8"}
SHAPE_MULTIPLE = 16                # float8 GEMMs (torch._scaled_mm) need K and N multiples of 16


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


def cast_s(hardware: HardwareProfile, elements: float, hp_bytes: int = 2, compiled: bool = False) -> float:
    """Seconds of float8 casts over ``elements`` high-precision elements in all (HBM-bound), with
    their kernels' launches: eager, every element is read twice (amax, then scale) and written once
    in one byte; compiled, the amax rides on the producer's kernel (``CAST_PASSES``)."""
    passes = CAST_PASSES[bool(compiled)]
    nbytes = (passes * hp_bytes + 1) * elements
    return (nbytes / (hardware.memory_bandwidth * hardware.efficiency.memory)
            + CASTS_PER_STEP * passes * hardware.efficiency.kernel_overhead)


def float8_gemm_s(hardware: HardwareProfile, flops: float, m: float, n: float, k: float, *,
                  recipe: str = "tensorwise", hp_bytes: int = 2, compiled: bool = False) -> float | None:
    """Seconds one rank spends on a Linear's three GEMMs (``flops``: forward + backward, this
    rank's share) at its per-rank shape (M rows, N out, K in) in float8, its six casts included;
    None where the hardware has no such GEMM or the shape cannot take it (K or N not a multiple
    of 16). The GEMMs run at the shape's efficiency (``gemm_efficiency``) against the float8 peak."""
    peak8 = float8_peak(hardware, recipe)
    if not peak8 or any(abs(d - SHAPE_MULTIPLE * round(d / SHAPE_MULTIPLE)) > 1e-6 for d in (n, k)):
        return None
    eff = gemm_efficiency(hardware, m, n, k)
    elements = 2 * (m * k) + 2 * (k * n) + 2 * (m * n)   # the six casts' operands
    return flops / (peak8 * eff) + cast_s(hardware, elements, hp_bytes, compiled)


def linear_cost(hardware: HardwareProfile, tokens: float, k: float, n: float,
                recipe: str = "tensorwise", compiled: bool = False) -> LinearPrecisionCost | None:
    """The cost of one Linear of (K in, N out) over ``tokens`` rows on one rank, per call (the
    dimensions a rank sees: a tensor-parallel shard's K or N); None where the hardware has no
    float8 or the shape cannot take it. The same terms the cluster search prices (``float8_gemm_s``)."""
    flops = 3 * 2.0 * tokens * k * n
    total = float8_gemm_s(hardware, flops, tokens, n, k, recipe=recipe, compiled=compiled)
    if total is None:
        return None
    eff = gemm_efficiency(hardware, tokens, n, k)
    fp8 = flops / (float8_peak(hardware, recipe) * eff)
    return LinearPrecisionCost(flops / (hardware.peak("bf16") * eff), fp8, total - fp8)


def float8_gather_saving_bytes(k: float, n: float, dp: int) -> float:
    """Bytes one rank receives less per FSDP all-gather of a (K, N) weight gathered in float8
    rather than bf16 over ``dp`` ranks: one byte per element of the (dp - 1)/dp it receives."""
    return k * n * (dp - 1) / dp if dp > 1 else 0.0
