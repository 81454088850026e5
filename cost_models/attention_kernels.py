"""Fused-attention kernels slower than the flash class a profile's ``efficiency.attention`` measures.

A profile prices fused attention at one kernel class: the cuDNN / FlashAttention-3 class on Hopper
(``h100_sxm.json``'s sources). A runtime that runs another kernel -- NeMo AutoModel's GPT-OSS recipes
run FlexAttention, for the sinks and the sliding window -- spends longer on the same work. Each kernel
here states its published speed against the profile's class, forward and backward apart (they differ),
and :func:`with_attention_kernel` gives the profile that prices it: ``efficiency.attention`` times the
combined ratio, the two passes weighted by the time the profile's own kernel spends in each.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cost_models.errors import UnknownHardwareError
from cost_models.hardware.profile import HardwareProfile


@dataclass(frozen=True)
class AttentionKernel:
    """A kernel's forward and backward speed as fractions of the profile's attention class on
    ``hardware`` (profile names), and the forward's share of that class's forward + backward time."""

    name: str
    forward: float
    backward: float
    forward_time_share: float
    hardware: tuple[str, ...]
    source: str

    def scale(self) -> float:
        """Combined speed against the profile's kernel: 1 / (share_f / forward + share_b / backward)."""
        f = self.forward_time_share
        return 1.0 / (f / self.forward + (1.0 - f) / self.backward)


# FA3 on H100 (h100_sxm.json's sources): forward ~62 % of peak, forward + backward ~50 % with the
# backward's 2.5x FLOPs -- so the forward is 0.50 / (3.5 x 0.62) = 23 % of the time
HOPPER = ("h100_sxm", "h800", "h200", "h100_hbm2e_500w")
FLEX_ATTENTION = AttentionKernel(
    "flex_attention", forward=0.85, backward=0.76, forward_time_share=0.23, hardware=HOPPER,
    source="FlexAttention on H100: forward 85 % and backward 76 % of FlashAttention-3 on average (Driss Guessous, "
           "'FlexAttention: The Flexibility of PyTorch With the Performance of FlashAttention', GTC 2025 session "
           "abstract, as the PyTorch blog's GTC 2025 page quotes it); FA3's forward share of the time from "
           "h100_sxm.json's FlashAttention-3 source (forward 62 % of peak, forward + backward 50 %)")
KERNELS = {k.name: k for k in (FLEX_ATTENTION,)}


def with_attention_kernel(hw: HardwareProfile, kernel: AttentionKernel | str) -> HardwareProfile:
    """``hw`` pricing its fused attention as ``kernel`` runs it (``efficiency.attention`` times
    :meth:`AttentionKernel.scale`, the source added). Refused where the kernel's published ratio is not
    against this hardware's attention class, or the profile has no attention efficiency to scale."""
    if isinstance(kernel, str):
        if kernel not in KERNELS:
            raise UnknownHardwareError(f"with_attention_kernel(kernel={kernel!r}): known kernels {sorted(KERNELS)}")
        kernel = KERNELS[kernel]
    if hw.name not in kernel.hardware or hw.efficiency.attention <= 0:
        raise UnknownHardwareError(
            f"with_attention_kernel(hw={hw.name!r}, kernel={kernel.name!r}): its speed is published against the "
            f"attention class of {list(kernel.hardware)} (a profile with efficiency.attention > 0), not this one")
    eff = dataclasses.replace(hw.efficiency, attention=hw.efficiency.attention * kernel.scale())
    return hw.with_overrides(efficiency=eff, sources=tuple(hw.sources) + (kernel.source,))
