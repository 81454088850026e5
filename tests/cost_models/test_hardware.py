"""Hardware profiles: every datasheet file loads, cites sources, and is self-consistent."""
import pytest

from cost_models.errors import UnknownHardwareError
from cost_models.hardware import HardwareProfile, list_hardware, load_hardware

SHIPPED = ["a100_40gb", "a100_80gb", "ascend_910b", "ascend_910c", "b200", "gb200", "h100_hbm2e_500w", "h100_sxm", "h200",
           "h800", "mi300x"]


def test_list_has_every_required_profile_and_cpu():
    assert list_hardware() == SHIPPED + ["cpu"]


@pytest.mark.parametrize("name", SHIPPED)
def test_profile_is_complete(name):
    h = load_hardware(name)
    assert h.sources and all(len(s) > 20 for s in h.sources)
    assert h.peak("bf16") > h.peak("fp32") > 0
    assert h.peak("torch.bfloat16") == h.peak("bf16")
    assert h.inter_node.bandwidth < h.intra_node.bandwidth
    assert h.devices_per_node == (72 if name == "gb200" else 8) and h.memory_capacity > 32 * 2**30
    assert HardwareProfile.from_dict(h.to_dict()) == h


def test_float8_peaks_where_the_hardware_has_float8():
    """Hopper and Blackwell (and MI300X) list a dense float8 peak, twice their BF16 one; Ampere, Ascend
    and the CPU none (so no plan prices float8 there); MXFP8 only on Blackwell."""
    for name in SHIPPED:
        h = load_hardware(name)
        fp8 = h.peak_flops.get("fp8")
        has = name.startswith(("h1", "h2", "h8", "b2", "gb2", "mi3"))
        assert (fp8 is not None) == has, name
        if has:
            assert fp8 == pytest.approx(2 * h.peak("bf16"), rel=0.01), name
        assert ("mxfp8" in h.peak_flops) == (name in ("b200", "gb200")), name


def test_formulas_md_peaks():
    assert load_hardware("H100-SXM").peak("bf16") == pytest.approx(989e12, rel=1e-3)
    assert load_hardware("b200").peak("bf16") == 2250e12
    assert load_hardware("a100_80gb").peak("bf16") == 312e12


def test_unknown_name_is_a_typed_error_naming_it():
    with pytest.raises(UnknownHardwareError, match="tpu_v9"):
        load_hardware("tpu_v9")


def test_cpu_profile_is_measured_once_then_cached(tmp_path, monkeypatch):
    import cost_models.hardware.host as host

    monkeypatch.setenv("AUTOPLAN_CACHE_DIR", str(tmp_path))
    # small GEMMs: the caching is under test, not the measurement (16-bit CPU GEMMs of the real
    # size take over a minute here)
    monkeypatch.setattr(host, "_GEMM_BIG", 512)
    monkeypatch.setattr(host, "_GEMM_SWEEP", (64, 128, 256))
    calls = []
    real = host.measure_host_profile
    monkeypatch.setattr(host, "measure_host_profile", lambda: calls.append(1) or real(reps=2))
    first = load_hardware("cpu")
    second = load_hardware("cpu")
    assert calls == [1] and first == second
    assert first.device_type == "cpu" and first.peak("fp32") > 0 and first.memory_bandwidth > 0
    assert first.efficiency.kernel_overhead > 0
    assert list((tmp_path / "hardware").glob("cpu-*.json"))
