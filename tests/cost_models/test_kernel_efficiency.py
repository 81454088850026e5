"""Measured kernels anchor the cost model's curves: what ``autoplan profile --kernels`` measures,
what it writes into a profile, and how the pricing reads it back."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from autoplan.presets import build_preset, use_fused_attention
from autoplan.search.experts.search import expert_gemm_shapes, grouped_expert_time
from autoplan.search.mesh.search import ClusterSearch
from autoplan.search.pricing.kernels import priced_kernels
from autoplan import cost_commands as cli
from cost_models.compute import (attention_time, causal_density, gemm_efficiency, grouped_gemm_efficiency,
                                 measured_efficiency)
from cost_models.hardware import load_hardware
from cost_models.hardware.profile import Efficiency, HardwareProfile
from cost_models.kernel_efficiency import KernelShape, measure, predicted_seconds, with_measured


@pytest.fixture(scope="module")
def mixtral_8x7b():
    """Mixtral-8x7B's shape, 2 layers, on meta, attention as SDPA."""
    model = use_fused_attention(build_preset("mixtral-8x7b", num_layers=2))
    model.config.use_cache = False
    return model


def _with(hw: HardwareProfile, *points) -> HardwareProfile:
    return hw.with_overrides(efficiency=dataclasses.replace(hw.efficiency, kernels=points))


def test_kernel_points_are_checked_and_survive_json():
    with pytest.raises(ValueError, match="kind in"):
        Efficiency(kernels=(("conv", 1, 1, 1, 0.5),))
    with pytest.raises(ValueError, match="efficiency"):
        Efficiency(kernels=(("gemm", 128, 128, 128, 1.5),))
    with pytest.raises(ValueError, match="is not a"):
        Efficiency(kernels=(("gemm", 128, 128),))
    hw = _with(load_hardware("h100_sxm"), ("gemm", 4096, 4096, 4096, 0.7), ("attention", 4096, 128, 64, 0.1))
    back = HardwareProfile.from_dict(json.loads(json.dumps(hw.to_dict())))
    assert back.efficiency.kernels == hw.efficiency.kernels


def test_a_measured_point_anchors_the_curve_and_kinds_stay_apart():
    hw = load_hardware("h100_sxm")
    assert measured_efficiency(hw, "gemm", 1024, 1024, 1024, lambda *a: 1.0) is None   # datasheet: no points
    m = _with(hw, ("gemm", 4096, 4096, 4096, 0.6))
    assert gemm_efficiency(m, 4096, 4096, 4096) == pytest.approx(0.6)
    # elsewhere the curve carries the measurement: the same ratio to the datasheet curve
    assert gemm_efficiency(m, 512, 4096, 2048) / gemm_efficiency(hw, 512, 4096, 2048) == pytest.approx(
        0.6 / gemm_efficiency(hw, 4096, 4096, 4096))
    # a grouped GEMM without grouped points is one GEMM of its shape; with them, its own number
    assert grouped_gemm_efficiency(m, 4096, 4096, 4096) == pytest.approx(0.6)
    g = _with(hw, ("grouped_gemm", 1024, 5760, 2880, 0.45), ("grouped_gemm", 16384, 5760, 2880, 0.7))
    assert grouped_gemm_efficiency(g, 1024, 5760, 2880) == pytest.approx(0.45)
    assert grouped_gemm_efficiency(g, 16384, 5760, 2880) == pytest.approx(0.7)   # the nearest point
    assert gemm_efficiency(g, 1024, 5760, 2880) == gemm_efficiency(hw, 1024, 5760, 2880)


def test_measured_attention_prices_the_work_its_mask_does_per_span():
    hw = load_hardware("h100_sxm")
    peak = hw.peak("bf16")
    s, d, heads = 4096, 64, 64
    full = 3.5 * 4 * s * s * d * heads
    m = _with(hw, ("attention", s, s, d, 0.3), ("attention", s, 128, d, 0.05))
    assert attention_time(m, peak, full, s, s, d, True) == pytest.approx(full * 0.5 / (peak * 0.3))
    band = causal_density(s, s, ("window", 128))
    assert attention_time(m, peak, full, s, s, d, True, band) == pytest.approx(full * band / (peak * 0.05))
    # the datasheet profile prices both at one efficiency
    assert attention_time(hw, peak, full, s, s, d, True, band) / band == pytest.approx(
        attention_time(hw, peak, full, s, s, d, True) / 0.5)


def test_measure_times_each_kernel_and_records_a_failure_instead_of_raising():
    hw = load_hardware("cpu")
    shapes = [KernelShape("gemm", 64, 128, 64), KernelShape("grouped_gemm", 32, 64, 64, groups=4),
              KernelShape("attention", 128, 128, 32, groups=2),
              KernelShape("attention", 128, 128, 32, groups=2, window=16)]
    frame = measure(shapes, hw, dtype=torch.float32)
    assert list(frame["kind"]) == ["gemm", "grouped_gemm", "attention", "attention"]
    ok = frame[frame["error"] == ""]
    assert len(ok) >= 3 and (ok["measured_s"] > 0).all()
    peak = hw.peak("float32")
    assert (ok["measured_eff"] == ok["flops"] / (ok["measured_s"] * peak)).all()
    assert frame.loc[0, "flops"] == 6 * 64 * 128 * 64
    assert frame.loc[3, "span"] == 16 and frame.loc[2, "span"] == 128
    # the windowed kernel's backward has no CPU implementation (FlexAttention): kept, with why
    failed = frame[frame["error"] != ""]
    assert failed.empty or failed["measured_s"].isna().all()
    for s, row in zip(shapes, frame.itertuples()):
        assert row.predicted_s == pytest.approx(predicted_seconds(hw, s, "float32", 4))


def test_with_measured_writes_points_a_search_then_prices_with(tmp_path):
    hw = load_hardware("h100_sxm")
    frame = measure([KernelShape("grouped_gemm", 32, 64, 64, groups=2)], load_hardware("cpu"), dtype=torch.float32)
    frame.loc[0, "measured_eff"] = 0.25            # as a device would have measured it
    measured = with_measured(hw, frame, "test")
    assert measured.efficiency.kernels == (("grouped_gemm", 32.0, 64.0, 64.0, 0.25),)
    assert measured.sources[-1] == "test"
    again = with_measured(measured, frame.assign(measured_eff=0.5), "again")
    assert again.efficiency.kernels == (("grouped_gemm", 32.0, 64.0, 64.0, 0.5),)   # replaced, not added
    path = tmp_path / "h100_measured.json"
    path.write_text(json.dumps(measured.to_dict()))
    assert load_hardware(path).efficiency.kernels == measured.efficiency.kernels
    assert load_hardware(str(path)) == load_hardware(path)
    with pytest.raises(Exception, match="no such file"):
        load_hardware(str(tmp_path / "missing.json"))


def test_priced_kernels_are_the_shapes_the_search_prices(mixtral_8x7b):
    search = ClusterSearch.of(mixtral_8x7b, 64, hardware="h100_sxm", batch=(64, 1024), microbatch_sizes=(1,))
    shapes = priced_kernels(search, b=1, tp=2, ep=8)
    kinds = {s.kind for s in shapes}
    assert kinds == {"gemm", "grouped_gemm", "attention"}
    g = search.moe_groups[0]
    want = {(round(m), int(n), int(k), local) for m, n, k, local in expert_gemm_shapes(g, tokens=1024, ep=8, etp=1)}
    assert {(s.m, s.n, s.k, s.groups) for s in shapes if s.kind == "grouped_gemm"} == want
    att = [s for s in shapes if s.kind == "attention"]
    assert len(att) == 1 and (att[0].m, att[0].k, att[0].window) == (1024, 128, 0) and att[0].groups == 32
    # tensor parallelism narrows the weight GEMMs one rank runs (the vocabulary head's N halves)
    head = max((s for s in shapes if s.kind == "gemm"), key=lambda s: s.n)
    whole = max((s for s in priced_kernels(search, b=1, tp=1, ep=8) if s.kind == "gemm"), key=lambda s: s.n)
    assert head.n * 2 == whole.n
    # and the experts' pricing reads a measured grouped point at exactly those shapes
    ctx = search.ctx(8, 1, 1, "replicate", "none", 1, 8)
    slow = dataclasses.replace(ctx, hardware=_with(ctx.hardware, *(
        ("grouped_gemm", s.m, s.n, s.k, 0.5 * grouped_gemm_efficiency(ctx.hardware, s.m, s.n, s.k))
        for s in shapes if s.kind == "grouped_gemm")))
    kw = dict(tokens=1024, dtype_bytes=2, ep=8, etp=1)
    assert grouped_expert_time(slow, g, **kw) > grouped_expert_time(ctx, g, **kw)


def test_profile_kernels_command_measures_a_preset_and_writes_a_profile(tmp_path, capsys, monkeypatch):
    out, prof = tmp_path / "k.csv", tmp_path / "cpu_measured.json"
    real = cli.measure

    def light(shapes, hw, **kw):   # this CPU times the 200K-vocabulary head's backward in seconds: not it
        return real([s for s in shapes if s.flops() < 5e9], hw, **kw)
    monkeypatch.setattr(cli, "measure", light)
    rc = cli.main(["profile", "--kernels", "--preset", "gpt-oss-20b", "--layers", "2", "--seq", "8", "--ep", "8",
                   "--hardware", "cpu", "--out", str(out), "--write-profile", str(prof)])
    text = capsys.readouterr().out
    assert rc in (0, 1) and "grouped_gemm" in text and out.is_file()
    points = load_hardware(prof).efficiency.kernels
    assert {p[0] for p in points} >= {"gemm", "grouped_gemm", "attention"}
    assert all(0 < p[4] <= 1 and not math.isnan(p[4]) for p in points)
    model = use_fused_attention(build_preset("gpt-oss-20b", num_layers=2))
    assert all(getattr(m.config, "_attn_implementation", "sdpa") == "sdpa"
               for m in model.modules() if getattr(m, "config", None) is not None)
