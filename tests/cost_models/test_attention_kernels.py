"""A runtime's attention kernel priced at its published speed against the profile's flash class."""
import pytest

from cost_models.attention_kernels import FLEX_ATTENTION, with_attention_kernel
from cost_models.compute import attention_time
from cost_models.errors import UnknownHardwareError
from cost_models.hardware import load_hardware


def test_flex_attention_prices_its_published_forward_and_backward_speed_on_hopper():
    hw = load_hardware("h100_sxm")
    flex = with_attention_kernel(hw, "flex_attention")
    # forward 85 %, backward 76 % of FA3, FA3's forward 23 % of its time: 1 / (0.23/0.85 + 0.77/0.76)
    assert FLEX_ATTENTION.scale() == pytest.approx(1 / (0.23 / 0.85 + 0.77 / 0.76))
    assert flex.efficiency.attention == pytest.approx(hw.efficiency.attention * FLEX_ATTENTION.scale())
    assert flex.sources[-1] == FLEX_ATTENTION.source and flex.name == hw.name
    peak, full = hw.peak("bf16"), 3.5 * 4 * 4096 * 4096 * 64 * 64
    slower = attention_time(flex, peak, full, 4096, 4096, 64, True) / attention_time(hw, peak, full, 4096, 4096, 64, True)
    assert slower == pytest.approx(1 / FLEX_ATTENTION.scale())
    assert flex.efficiency.compute == hw.efficiency.compute   # GEMMs untouched


def test_a_kernel_is_only_applied_where_its_speed_was_published():
    with pytest.raises(UnknownHardwareError, match="published against"):
        with_attention_kernel(load_hardware("a100_80gb"), FLEX_ATTENTION)
    with pytest.raises(UnknownHardwareError, match="published against"):
        with_attention_kernel(load_hardware("b200"), "flex_attention")   # no attention class to scale
    with pytest.raises(UnknownHardwareError, match="known kernels"):
        with_attention_kernel(load_hardware("h100_sxm"), "sdpa_math")
