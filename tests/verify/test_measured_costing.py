"""The planner's costs with and without a runtime calibration of this host (cost_models.runtime)."""
from __future__ import annotations

import pytest

from autoplan.search.pricing.costing import CostContext
from hyper_parallel.core.collective import Collective
from autoplan.search.units.work import Work
from cost_models import load_hardware, mesh_links
from cost_models.collectives import collective_terms
from cost_models.hardware import Link
from cost_models.runtime import RuntimeOverheads, load_runtime, save_runtime

RT = RuntimeOverheads(world=4, op_s=5e-6, dtensor_op_s=1e-4, compute_scale=3.0, collective_s=1e-3,
                      link=Link("gloo_test", bandwidth=5e8, latency=3e-4), sources="test")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    return tmp_path


def _ctx(hw, shape=(4,), names=("tp",), **kw):
    return CostContext(hardware=hw, topology=mesh_links(shape, names, hw), dtype="torch.float32", tp_dim="tp",
                       dp_dim=None, dp=1, fsdp=False, param_bytes_per_element=4, optimizer_bytes_per_element=8, **kw)


def _cpu_profile(cache):
    # a fixed profile so the test does not measure the host
    h100 = load_hardware("h100_sxm")
    return h100.with_overrides(name="cpu", device_type="cpu")


def test_runtime_roundtrip(cache):
    assert load_runtime(4) is None
    save_runtime(RT)
    assert load_runtime(4) == RT
    assert load_runtime(2) is None


def test_cpu_context_picks_up_calibration_for_its_world(cache):
    hw = _cpu_profile(cache)
    assert _ctx(hw).runtime is None          # nothing cached yet: bare profile
    save_runtime(RT)
    ctx = _ctx(hw)
    assert ctx.runtime == RT
    assert _ctx(hw, shape=(2,)).runtime is None   # calibrations are per world size
    w = Work(flops=1e9, bytes=1e6, kernels=30)
    bare = _ctx(hw, runtime=None)
    roof = bare.compute_time(w, 1) - 30 * hw.efficiency.kernel_overhead
    assert ctx.compute_time(w, 1) == pytest.approx(3.0 * roof + 30 * 5e-6)
    # sharded units run their ops on DTensors
    assert ctx.compute_time(w, 4) == pytest.approx(3.0 * roof / 4 + 30 * (5e-6 + 1e-4))
    c = Collective("all_reduce", "forward", 65536, count=2, dim="tp")
    want = 2 * (collective_terms("all_reduce", 65536, 4).time(RT.link) + 1e-3)
    assert ctx.collective_time(c) == pytest.approx(want)


def test_datasheet_profiles_ignore_calibrations(cache):
    save_runtime(RT)
    hw = load_hardware("h100_sxm")
    ctx = _ctx(hw)
    assert ctx.runtime is None
    w = Work(flops=1e12, bytes=1e9, kernels=10)
    eff = hw.efficiency
    want = max(1e12 / (hw.peak("torch.float32") * eff.compute), 1e9 / (hw.memory_bandwidth * eff.memory)) \
        + 10 * eff.kernel_overhead
    assert ctx.compute_time(w, 1) == pytest.approx(want)


def test_explicit_runtime(cache):
    hw = load_hardware("h100_sxm")
    ctx = CostContext.with_runtime(RT, hardware=hw, topology=mesh_links((4,), ("tp",), hw), dtype="bf16",
                                   tp_dim="tp", dp_dim=None, dp=1, fsdp=False, param_bytes_per_element=2,
                                   optimizer_bytes_per_element=12)
    assert ctx.runtime is RT


def test_optimizer_time(cache):
    hw = _cpu_profile(cache)
    rt = RuntimeOverheads(**{**RT.to_dict(), "link": RT.link, "optimizer_tensor_s": 2e-5,
                             "optimizer_dtensor_tensor_s": 5e-4})
    ctx = _ctx(hw, runtime=rt)
    t_mem = 28.0 * 1e6 / (hw.memory_bandwidth * hw.efficiency.memory)
    assert ctx.optimizer_time(10, 1e6, sharded=False) == pytest.approx(3.0 * t_mem + 10 * 2e-5)
    assert ctx.optimizer_time(10, 1e6, sharded=True) == pytest.approx(3.0 * t_mem + 10 * 5e-4)
    assert _ctx(hw, runtime=None).optimizer_time(10, 1e6, True) == pytest.approx(
        t_mem + 10 * hw.efficiency.kernel_overhead)


def test_old_calibration_files_load(cache):
    """Calibrations written before the optimizer fields existed still load (fields default to 0)."""
    import json

    from cost_models.runtime import _path

    data = RT.to_dict()
    data.pop("optimizer_tensor_s")
    data.pop("optimizer_dtensor_tensor_s")
    _path(4).parent.mkdir(parents=True, exist_ok=True)
    _path(4).write_text(json.dumps(data))
    assert load_runtime(4).optimizer_tensor_s == 0.0


def test_memory_scale_is_recorded_not_used(cache):
    hw = _cpu_profile(cache)
    rt = RuntimeOverheads(**{**RT.to_dict(), "link": RT.link, "memory_scale": 0.5})
    ctx, bare = _ctx(hw, runtime=rt), _ctx(hw, runtime=None)
    w = Work(flops=1e6, bytes=1e9, kernels=0)      # streaming-bound
    assert ctx.compute_time(w, 1) == pytest.approx(3.0 * bare.compute_time(w, 1))


def test_runtime_cli_is_wired(capsys):
    from autoplan.cost_commands import main

    with pytest.raises(SystemExit) as exc:
        main(["runtime", "--help"])
    assert exc.value.code == 0
    assert "--world" in capsys.readouterr().out


@pytest.mark.parametrize("runtime", [None, RT])
def test_fsdp_priced_per_fsdp_unit_adds_up(cache, runtime):
    """bytes per planner unit + latency once per FSDP unit == the collectives priced one per FSDP unit."""
    from cost_models import load_hardware as lh

    hw = lh("h100_sxm")
    topo = mesh_links((4, 2), ("dp", "tp"), hw)
    ctx = CostContext(hardware=hw, topology=topo, dtype="bf16", tp_dim="tp", dp_dim="dp", dp=4, fsdp=True,
                      param_bytes_per_element=2, optimizer_bytes_per_element=12, runtime=runtime)
    units = [1e6, 3e6, 2e3]                      # attention, MLP, norms of one block
    split = sum(ctx.comm_time(ctx.fsdp_collectives(b, 2), latency=False) for b in units) + ctx.fsdp_latency_time(1)
    fused = ctx.comm_time(ctx.fsdp_collectives(sum(units), 2))
    assert split == pytest.approx(fused, rel=1e-9)
    per_unit = sum(ctx.comm_time(ctx.fsdp_collectives(b, 2)) for b in units)
    assert per_unit > fused                      # today's per-planner-unit pricing counts latency 3x
    assert ctx.collective_time(Collective("all_reduce", "forward", 1024, dim="tp"), latency=False) > 0
