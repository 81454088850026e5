"""The best model-FLOPs utilisation published per accelerator and model class, and the plan note a
prediction above it earns.

Why: the cost model's errors are not symmetric in what the planner does with them -- the search
picks the plan whose price is lowest, so its pick sits where the model is most optimistic. A
predicted MFU well above what anyone has published on that hardware is the visible symptom; the
note says so and names the term of the prediction that carries it (compute, bubble, exposed
data-parallel traffic), so a reader knows which number to doubt. Nothing here changes a price.

MFU = model FLOPs (no recomputation) / (step time x devices x dense bf16 peak). Sources below;
each figure is the highest we know for that class on that part, under its source's FLOP count.
"""
from __future__ import annotations

from dataclasses import dataclass

MARGIN = 1.10   # a prediction more than 10 % above the best published gets a note

# (hardware profile, "dense" | "moe") -> (MFU, citation)
BEST_PUBLISHED_MFU: dict[tuple[str, str], tuple[float, str]] = {
    ("a100_80gb", "dense"): (0.611, "pytorch/torchtitan docs/performance.md: Llama 2 13B, FSDP2 on 64 A100 80GB, "
                                    "local batch 2, no activation checkpointing, MFU 61.1 %"),
    ("h100_sxm", "dense"): (0.47, "NVIDIA/Megatron-LM README, Performance Benchmarking: GPT 2B-462B on up to 6,144 "
                                  "H100, 'up to 47 % Model FLOP Utilization'"),
    ("h800", "dense"): (0.47, "as h100_sxm (same SXM compute; NVLink halved)"),
    ("h100_sxm", "moe"): (0.282, "NVIDIA-NeMo/Automodel docs/performance-summary.md: GPT-OSS 20B on 8 H100, BF16, "
                                 "279 model TFLOP/s per GPU (28.2 % of 989)"),
    ("h800", "moe"): (0.282, "as h100_sxm"),
    ("b200", "moe"): (0.097, "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (26.02): GPT-OSS 120B BF16 "
                             "on 64 B200, 219 model TFLOP/s per GPU (9.7 % of 2,250)"),
}


@dataclass(frozen=True)
class StepTerms:
    """Where a predicted step goes on the busiest rank (seconds)."""
    busy_s: float        # compute + exposed TP / CP / EP communication of the rank's stages
    bubble_s: float      # pipeline idle time
    dp_s: float          # exposed data-parallel traffic + optimizer step


def predicted_mfu(model_flops: float, step_s: float, devices: int, peak: float) -> float:
    return model_flops / (step_s * devices * peak) if step_s > 0 and devices > 0 and peak > 0 else 0.0


def mfu_note(hardware: str, moe: bool, mfu: float, terms: StepTerms) -> str | None:
    """A plan note when ``mfu`` exceeds the best published for (hardware, class) by more than
    :data:`MARGIN`, naming the term with the largest share of the step; None otherwise (or when
    nothing is published for that pair)."""
    cls = "moe" if moe else "dense"
    best = BEST_PUBLISHED_MFU.get((hardware, cls))
    if best is None or mfu <= best[0] * MARGIN:
        return None
    step = terms.busy_s + terms.bubble_s + terms.dp_s
    shares = {"compute (busy: GEMMs at the profile's shape efficiency, exposed TP/EP traffic)": terms.busy_s,
              "pipeline bubble": terms.bubble_s, "exposed data-parallel traffic + optimizer": terms.dp_s}
    term, secs = max(shares.items(), key=lambda kv: kv[1])
    # the compute term carries an optimistic MFU when it is almost the whole step: the other terms
    # are already small, so only the per-GEMM efficiency can make the plan that fast
    return (f"predicted MFU {mfu:.3f} is {mfu / best[0]:.2f}x the best published for {cls} models on {hardware} "
            f"({best[0]:.3f}: {best[1]}); the term that makes it so: {term}, {secs / step:.0%} of the step "
            f"(bubble {terms.bubble_s / step:.0%}, data-parallel {terms.dp_s / step:.0%}) -- its speed-up over "
            "published layouts is the cost model's optimism in that term until measured")
