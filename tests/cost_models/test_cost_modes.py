"""The one cost model's pieces the search asks for: op-class compute, overlap per dp mode,
ZeRO-1 / FSDP state, recomputation, optimizer step, memory headroom."""
import pytest

from autoplan.search.pricing.costing import CostContext
from autoplan.search.units.work import Work
from cost_models import load_hardware, mesh_links
from cost_models.compute import gemm_efficiency
from cost_models.overlap import DP_OVERLAP, dp_overlap


def _ctx(**kw):
    hw = load_hardware("h100_sxm")
    topo = mesh_links((8, 8), ("dp", "tp"), hw)
    base = dict(hardware=hw, topology=topo, dtype="bf16", tp_dim="tp", dp_dim="dp", dp=8, fsdp=False,
                param_bytes_per_element=2, optimizer_bytes_per_element=12, runtime=None)
    base.update(kw)
    return CostContext(**base)


def test_gemm_efficiency_is_the_published_large_gemm_efficiency_times_shape():
    hw = load_hardware("h100_sxm")
    assert hw.efficiency.compute == pytest.approx(0.801)   # MAMF 792.1 / 989
    big = gemm_efficiency(hw, 16384, 16384, 16384)
    assert 0.77 < big < 0.801   # MAMF is the best shape found; the curve stays at or below it
    # a 128-token GEMM runs at half the efficiency on that axis (dim_half = 128)
    assert gemm_efficiency(hw, 128, 4096, 4096) == pytest.approx(0.801 * 0.5 * (4096 / 4224) ** 2)


def test_non_gemm_time_adds_to_gemm_time():
    ctx = _ctx()
    hw = ctx.hardware
    gemm = Work(flops=2e12, gemms=((2e12, 8192, 8192, 8192),), kernels=0)
    other = Work(other_bytes=3e10, kernels=0)
    both = Work(flops=2e12, gemms=((2e12, 8192, 8192, 8192),), other_bytes=3e10, kernels=0)
    t_g, t_o = ctx.compute_time(gemm, 1), ctx.compute_time(other, 1)
    assert t_g == pytest.approx(2e12 / (hw.peak("bf16") * gemm_efficiency(hw, 8192, 8192, 8192)))
    assert t_o == pytest.approx(3e10 / (hw.memory_bandwidth * hw.efficiency.memory))
    assert ctx.compute_time(both, 1) == pytest.approx(t_g + t_o)   # a sum, not a max
    assert ctx.compute_time(both, 4) == pytest.approx((t_g + t_o) / 4)


def test_a_tensor_parallel_shard_prices_the_narrower_gemm_each_rank_runs():
    """tp divides a weight GEMM's N (column-parallel) or K (row-parallel); each rank's GEMM is
    narrower and fills the device less well. Per-head GEMMs (split "") and per-token work on a
    sequence shard (M divided) are priced at their own per-rank shapes."""
    ctx = _ctx()
    hw = ctx.hardware
    peak = hw.peak("bf16")
    f = 2.0 * 16384 * 768 * 6144
    col = Work(flops=f, gemms=((f, 16384, 768, 6144, "n"),), kernels=0)
    row = Work(flops=f, gemms=((f, 16384, 6144, 768, "k"),), kernels=0)
    head = Work(flops=f, gemms=((f, 16384, 768, 6144, ""),), kernels=0)
    assert ctx.compute_time(col, 8) == pytest.approx(f / 8 / (peak * gemm_efficiency(hw, 16384, 96, 6144)))
    assert ctx.compute_time(row, 8) == pytest.approx(f / 8 / (peak * gemm_efficiency(hw, 16384, 6144, 96)))
    assert ctx.compute_time(head, 8) == pytest.approx(f / 8 / (peak * gemm_efficiency(hw, 16384, 768, 6144)))
    assert ctx.compute_time(col, 8, split_tokens=True) == pytest.approx(
        f / 8 / (peak * gemm_efficiency(hw, 2048, 768, 6144)))
    # per FLOP, the tp-8 shard is slower than the whole GEMM: not a plain 1/8 of it
    assert ctx.compute_time(col, 8) > 1.3 * ctx.compute_time(col, 1) / 8


def test_structure_marks_the_dimension_tensor_parallel_divides():
    from cost_models.compute import gemm_split

    assert gemm_split(2048, 49152, 12288, True) == "n"     # up projection: column-parallel
    assert gemm_split(2048, 12288, 49152, True) == "k"     # down projection: row-parallel
    assert gemm_split(2048, 51200, 12288, True) == "n"     # vocabulary head
    assert gemm_split(196608, 2048, 128, False) == ""      # attention scores: heads are the batch


def test_overlap_per_dp_mode():
    assert dp_overlap("replicate").exposed(1.0, 100.0) == 1.0   # all-reduce after backward
    assert dp_overlap("zero1").exposed(1.0, 100.0) == 1.0
    assert dp_overlap("fsdp").exposed(1.0, 100.0) == pytest.approx(0.1)
    assert dp_overlap("fsdp").exposed(1.0, 0.0) == pytest.approx(1.0)
    assert set(DP_OVERLAP) == {"replicate", "zero1", "fsdp"}
    with pytest.raises(ValueError, match="dp_mode"):
        dp_overlap("ddp2")


def test_state_bytes_and_collectives_per_dp_mode():
    rep, z1, fs = _ctx(dp_mode="replicate"), _ctx(dp_mode="zero1"), _ctx(dp_mode="fsdp", fsdp=True)
    b = 8e9
    assert rep.state_bytes(b, 1) == {"params": 8e9, "grads": 8e9, "optimizer": 4.8e10}
    assert z1.state_bytes(b, 1) == {"params": 8e9, "grads": 8e9, "optimizer": 6e9}
    assert fs.state_bytes(b, 1) == {"params": 1e9, "grads": 1e9, "optimizer": 6e9}
    assert [c.kind for c in rep.ddp_collectives(b, 1)] == ["all_reduce"]
    assert [c.kind for c in z1.ddp_collectives(b, 1)] == ["reduce_scatter", "all_gather"]
    # a ring all-reduce is a reduce-scatter + an all-gather; ZeRO-1 reduces the 16-bit model's
    # gradients in fp32 (twice the bytes), all-gathers 16-bit parameters: 1.5x the bf16 all-reduce
    rs, ag = z1.ddp_collectives(b, 1)
    assert rs.nbytes == 2 * ag.nbytes == 2 * b
    assert z1.comm_time([rs, ag]) == pytest.approx(1.5 * rep.comm_time(rep.ddp_collectives(b, 1)), rel=1e-3)
    assert [c.nbytes for c in fs.fsdp_collectives(b, 1)] == [b, b, 2 * b]
    assert z1.optimizer_elements(b, 1) == rep.optimizer_elements(b, 1) / 8


def test_recompute_and_optimizer():
    core = Work(flops=1e11, gemms=((1e11, 4096, 4096, 128),), other_bytes=1e9, kernels=3)
    w = Work(flops=1e12, gemms=((9e11, 4096, 4096, 4096), (1e11, 4096, 4096, 128)), other_bytes=2e9, kernels=9,
             core=core)
    full, sel, none = _ctx(recompute="full"), _ctx(recompute="selective"), _ctx(recompute="none")
    assert full.checkpoint_blocks and not sel.checkpoint_blocks
    assert full.recompute_time(w, 1) == pytest.approx(full.compute_time(w, 1) / 3)
    assert sel.recompute_time(w, 1) == pytest.approx(sel.compute_time(core, 1) / 3)
    assert none.recompute_time(w, 1) == 0.0
    hw = none.hardware
    assert none.optimizer_time(0, 1e9, False) == pytest.approx(28e9 / (hw.memory_bandwidth * hw.efficiency.memory))
    with pytest.raises(ValueError, match="recompute"):
        _ctx(recompute="some")


def test_memory_headroom_is_stated_in_the_profile():
    hw = load_hardware("a100_80gb")
    assert hw.memory_reserved == 2 * 2**30 and hw.memory_fragmentation == 0.05
    assert hw.usable_memory() == pytest.approx(hw.memory_capacity * 0.95 - 2 * 2**30)


def test_gradient_accumulation_regathers_fsdp_blocks():
    """pp=1 with m micro-batches under FSDP is gradient accumulation (Runner.forward_backward):
    FSDP2 gathers in every forward and backward and reduce-scatters every micro-batch, so all of
    the unit's dp traffic x m; replicated dp reduces once per step. A pipeline stage (p > 1) keeps
    blocks unsharded after backward and re-gathers only what the schedule finds resharded."""
    from autoplan.search.pipeline.search import PipelineChoice, UnitCost, _stage_dp, fsdp_gathers

    u = [UnitCost("layers.0", 1.0, 1.0, 1.0, dp_comm_s=3.0, dp_gather_s=1.0, fsdp=True)]
    flat = [UnitCost("layers.0", 1.0, 1.0, 1.0, dp_comm_s=3.0)]
    assert fsdp_gathers("1F1B", 1, 4) == (5,)
    assert _stage_dp(PipelineChoice("1F1B", 1, 1, 1, [0]), u, 0, 0, 1) == pytest.approx(3.0)
    assert _stage_dp(PipelineChoice("1F1B", 1, 1, 4, [0]), u, 0, 0, 1) == pytest.approx(12.0)
    assert _stage_dp(PipelineChoice("1F1B", 1, 1, 4, [0]), flat, 0, 0, 1) == pytest.approx(3.0)


def test_selective_recompute_keeps_34_sbh_per_layer_as_korthikanti():
    """formulas.md: with selective recomputation a Megatron GPT layer keeps 34*s*b*h bytes
    (16-bit activations): the attention core's s^2 tensors are freed, but its q/k/v inputs --
    the projections' outputs, which autoplan.parallelisms.recompute keeps saved -- are not."""
    import torch

    from autoplan.capture import capture
    from autoplan.models.gpt import build_gpt
    from autoplan.search.units.structure import model_structure

    b, s, h = 2, 64, 128
    g = model_structure(capture(build_gpt(dim=h, n_layers=2, n_heads=4, vocab_size=64, ffn_hidden=4 * h,
                                          max_seq_len=s), batch=(b, s), dtype=torch.bfloat16)).blocks[0]
    layer = g.attention.work.saved + g.mlp.work.saved + g.norm_work.saved + g.other_work.saved
    assert (layer - g.attention.work.core.saved) / (s * b * h) == pytest.approx(34, abs=0.2)


def test_the_head_carries_the_loss_the_capture_does_not_see():
    """The captured graph has no loss; the head unit adds the runners' F.cross_entropy (six passes over
    the logits in their dtype) or a stated other runtime's bytes per logit, and nothing else moves."""
    import torch

    from autoplan.capture import capture
    from autoplan.models.gpt import build_gpt
    from autoplan.search.units.structure import model_structure
    from autoplan.search.units.work import CROSS_ENTROPY_PASSES

    b, s, v = 2, 32, 96
    graph = capture(build_gpt(dim=64, n_layers=2, n_heads=4, vocab_size=v, ffn_hidden=256, max_seq_len=s),
                    batch=(b, s), dtype=torch.bfloat16)
    ours, fp32 = model_structure(graph), model_structure(graph, loss_bytes_per_logit=36.0)
    logits = b * s * v
    assert ours.head.logits_bytes == 2 * logits
    assert fp32.head.work.other_bytes - ours.head.work.other_bytes == pytest.approx((36 - 2 * CROSS_ENTROPY_PASSES)
                                                                                    * logits)
    assert ours.head.work.flops == fp32.head.work.flops and ours.rest.bytes == fp32.rest.bytes
    ctx = _ctx()
    assert ctx.compute_time(fp32.head.work, 1) > ctx.compute_time(ours.head.work, 1)
