"""The fused-attention and expert all-to-all terms (docs/costs.md): what each charges, checked
against the arithmetic of their cited sources on datasheet profiles."""
from __future__ import annotations

import dataclasses

import pytest

from autoplan.search.experts.search import DEEPSEEK_V3_RUNTIME, OUR_EXPERT_RUNTIME, ExpertRuntime
from cost_models.compute import attention_time, gemm_efficiency
from cost_models.hardware import load_hardware


def test_attention_causal_half_at_the_kernel_efficiency():
    hw = load_hardware("h100_sxm")
    peak = hw.peak("bf16")
    b, h, s, d = 4, 32, 4096, 128
    full = 3.5 * 4.0 * b * h * s * s * d                     # SDPA forward + backward, whole matrix
    causal = attention_time(hw, peak, full, s, s, d, causal=True)
    whole = attention_time(hw, peak, full, s, s, d, causal=False)
    assert causal == pytest.approx(whole / 2)
    shape = (s / (s + hw.efficiency.dim_half)) ** 2
    assert causal == pytest.approx(full / 2 / (peak * hw.efficiency.attention * shape))
    # FlashAttention-3's H100 table: ~50 % of peak on the causal work at long sequences
    assert 0.45 <= full / 2 / causal / peak <= 0.5
    # narrower heads run slower per FLOP; wider ones are not credited above head dim 128
    assert attention_time(hw, peak, full, s, s, 64, True) > causal
    assert attention_time(hw, peak, full, s, s, 256, True) == pytest.approx(causal)


def test_attention_without_a_measurement_is_the_gemm_price():
    hw = load_hardware("b200")
    assert hw.efficiency.attention == 0
    peak = hw.peak("bf16")
    f = 1e12
    assert attention_time(hw, peak, f, 4096, 4096, 128, True) == pytest.approx(
        f / (peak * gemm_efficiency(hw, 4096, 4096, 128)))


def test_expert_runtime_overlap_hides_at_most_the_compute():
    assert OUR_EXPERT_RUNTIME.ours and OUR_EXPERT_RUNTIME.exposed(2.0, 5.0) == 2.0
    assert DEEPSEEK_V3_RUNTIME.exposed(2.0, 5.0) == 0.0
    assert DEEPSEEK_V3_RUNTIME.exposed(2.0, 0.5) == pytest.approx(1.5)
    half = dataclasses.replace(OUR_EXPERT_RUNTIME, overlap=0.5)
    assert half.exposed(2.0, 5.0) == pytest.approx(1.0)
    assert "not overlapped" in OUR_EXPERT_RUNTIME.note() and "DualPipe" in DEEPSEEK_V3_RUNTIME.note()
    with pytest.raises(ValueError, match="overlap"):
        ExpertRuntime(overlap=1.5)


def test_contiguous_routing_reaches_fewer_ranks_than_independent():
    """AutoModel's fake balanced gate routes token t to experts (t * k + j) mod E: with E/ranks
    experts per rank a multiple of k, every token lands on one rank; independent picks spread."""
    fake = ExpertRuntime(dedup=True, routing="contiguous", source="test")
    learned = ExpertRuntime(dedup=True, source="test")
    assert fake.destinations(8, 8, 128) == 1.0            # 16 experts per rank, windows of 8 aligned to 8
    assert fake.destinations(64, 4, 128) == 2.0           # 2 experts per rank: a window of 4 spans 2 ranks
    assert fake.destinations(8, 4, 128) == 1.0            # ... of one node (16 experts per node)
    assert fake.destinations(32, 8, 384) == pytest.approx(4 / 3)   # 12 per rank: windows 0-7, 8-15, 16-23
    assert learned.destinations(8, 8, 128) == pytest.approx(8 * (1 - (7 / 8) ** 8))
    # the node copies a de-duplicating dispatch sends over the inter-node link
    assert fake.node_copies(8, 8, 256) == 1.0 and learned.node_copies(8, 8, 256) > 5
    assert OUR_EXPERT_RUNTIME.node_copies(8, 8, 256) == 8.0   # ours: every routed copy
    with pytest.raises(ValueError, match="routing"):
        ExpertRuntime(routing="round_robin")
