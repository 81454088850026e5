"""Roofline pricing, fitted corrections, profile-table override, op recording and replay."""
import math

import pytest

from cost_models.compute import ComputeModel, category, op_bytes, op_flops
from cost_models.hardware import Efficiency, HardwareProfile, Link
from autoplan.models.llama_ops import llama_block_ops, llama_model_ops
from cost_models.ops import OpSpec, TensorSpec, dedupe
from cost_models.profile_table import ProfileTable
from cost_models.profiler import TimingConfig, profile_ops

LINK = Link("l", 1e9, 1e-6)
HW = HardwareProfile(name="toy", vendor="x", device_type="cpu", peak_flops={"fp32": 1e12}, memory_bandwidth=1e11,
                     memory_capacity=1 << 30, devices_per_node=1, intra_node=LINK, inter_node=LINK,
                     efficiency=Efficiency(compute=0.5, memory=1.0, dim_half=64, kernel_overhead=2e-6, view_overhead=1e-7))


def mm(m, k, n, dtype="torch.float32"):
    return OpSpec("aten.mm.default", (TensorSpec((m, k), dtype, (k, 1)), TensorSpec((k, n), dtype, (n, 1))),
                  out=(TensorSpec((m, n), dtype),))


def test_gemm_roofline_has_shape_dependent_efficiency():
    big = mm(4096, 4096, 4096)
    assert op_flops(big) == 2 * 4096**3
    eff = 0.5 * (4096 / (4096 + 64)) ** 3
    assert ComputeModel(HW).roofline(big) == pytest.approx(2e-6 + 2 * 4096**3 / (1e12 * eff))
    # a skinny GEMM (M=8) runs at a much lower fraction of peak than a square one
    skinny = mm(8, 4096, 4096)
    rate = lambda s: op_flops(s) / (ComputeModel(HW).roofline(s) - 2e-6)  # noqa: E731
    assert rate(skinny) < rate(big) / 5


def test_memory_bound_and_view_ops():
    add = OpSpec("aten.add.Tensor", (TensorSpec((1024, 1024), "torch.float32"),) * 2,
                 out=(TensorSpec((1024, 1024), "torch.float32"),))
    assert category(add) == "elementwise" and op_bytes(add) == 3 * 4 * 1024**2
    assert ComputeModel(HW).roofline(add) == pytest.approx(2e-6 + 3 * 4 * 1024**2 / 1e11)
    view = OpSpec("aten.view.default", (TensorSpec((4, 4), "torch.float32"), ("__list__", 16)))
    assert category(view) == "view" and ComputeModel(HW).roofline(view) == 1e-7


def test_fit_recovers_a_synthetic_correction_and_table_overrides():
    specs = [mm(n, n, n) for n in (64, 128, 256, 512)]
    model = ComputeModel(HW)
    truth = [5e-6 + 3.0 * (model.roofline(s) - 2e-6) for s in specs]
    fixed, scale = model.fit(specs, truth)["gemm"]
    assert fixed == pytest.approx(5e-6, rel=1e-6) and scale == pytest.approx(3.0, rel=1e-6)
    held_out = mm(384, 384, 384)
    assert model.estimate(held_out) == pytest.approx(5e-6 + 3.0 * (model.roofline(held_out) - 2e-6))
    table = ProfileTable("toy").update(__import__("pandas").DataFrame([{"key": held_out.key, "op": held_out.op,
                                                                         "time_s": 0.123}]))
    model.table = table
    assert model.time(held_out) == 0.123 and model.time(specs[0]) == model.estimate(specs[0])


def test_profile_table_round_trip(tmp_path):
    import pandas as pd

    t = ProfileTable("dev", pd.DataFrame([{"key": "a", "op": "aten.x", "time_s": 1.0},
                                          {"key": "a", "op": "aten.x", "time_s": 2.0}]))
    assert len(t) == 1 and t.lookup("a") == 2.0
    path = t.save(tmp_path / "t.csv")
    assert ProfileTable.load("dev", path).lookup("a") == 2.0
    assert ProfileTable.load("dev", tmp_path / "none.csv").lookup("a") is None


def test_llama_block_ops_are_deduplicated_and_include_backward():
    ops = llama_block_ops(2, 32, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
    keys = [(o.phase, o.key) for o in ops]
    assert len(keys) == len(set(keys))
    names = {o.short_name for o in ops}
    assert {"mm", "_scaled_dot_product_flash_attention_for_cpu",
            "_scaled_dot_product_flash_attention_for_cpu_backward", "silu_backward"} <= names
    fwd_mm = sum(o.count for o in ops if o.short_name == "mm" and o.phase == "fwd")
    bwd_mm = sum(o.count for o in ops if o.short_name == "mm" and o.phase == "bwd")
    assert fwd_mm == 7 and bwd_mm == 14      # seven projections; dgrad + wgrad each
    model = llama_model_ops(2, 32, dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, n_layers=3, vocab_size=96)
    fwd_mm = sum(o.count for o in model if o.short_name == "mm" and o.phase == "fwd")
    assert fwd_mm == 3 * 7 + 1  # block recorded once, counted per layer; plus the output projection
    assert dedupe(ops + ops)[0].count == 2 * ops[0].count


def test_every_recorded_op_replays_on_cpu():
    ops = llama_model_ops(1, 16, dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, n_layers=1, vocab_size=40)
    frame = profile_ops(ops, cfg=TimingConfig(warmup=1, min_reps=1, max_reps=1))
    assert (frame["error"] == "").all(), frame[frame["error"] != ""]["error"].tolist()
    assert frame["time_s"].map(math.isfinite).all() and (frame["time_s"] > 0).all()
    assert len(frame) == len(ops)


def test_capture_graph_adapter_gives_replayable_specs():
    from autoplan.capture import capture
    from autoplan.models.llama import build_llama
    from autoplan.capture.views import specs_from_graph

    model = build_llama(device="meta", dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                        vocab_size=96, max_seq_len=32)
    specs = specs_from_graph(capture(model, batch=(2, 16)))
    gemms = [s for s in specs if category(s) == "gemm"]
    assert sum(s.count for s in gemms) == 3 * 7 + 1       # seven projections per block, plus the output
    assert any(category(s) == "attention" for s in specs)
    frame = profile_ops(specs, cfg=TimingConfig(warmup=1, min_reps=1, max_reps=1))
    assert (frame["error"] == "").all(), frame[frame["error"] != ""]["error"].tolist()
