"""The activation model against Korthikanti et al. 2022's per-layer closed forms."""
import pytest

from cost_models.activations import SavedActivation, activation_bytes, gpt_layer_activations

SHAPES = [(2048, 1, 12288, 96), (1024, 4, 4096, 32), (4096, 2, 8192, 64)]


@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_no_parallelism(s, b, h, a):
    items = gpt_layer_activations(s, b, h, a)
    assert activation_bytes(items) == pytest.approx(s * b * h * (34 + 5 * a * s / h))


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_tensor_parallel(s, b, h, a, t):
    items = gpt_layer_activations(s, b, h, a)
    assert activation_bytes(items, tp=t) == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))


@pytest.mark.parametrize("t", [2, 4, 8])
@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_tensor_and_sequence_parallel(s, b, h, a, t):
    items = gpt_layer_activations(s, b, h, a)
    got = activation_bytes(items, tp=t, sequence_parallel=True)
    assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h) / t)


@pytest.mark.parametrize("t", [1, 4])
def test_recomputation(t):
    s, b, h, a = 2048, 1, 12288, 96
    items = gpt_layer_activations(s, b, h, a)
    sel = activation_bytes(items, tp=t, sequence_parallel=True, checkpoint="selective")
    assert sel == pytest.approx(34 * s * b * h / t)
    assert activation_bytes(items, tp=t, checkpoint="full") == pytest.approx(2 * s * b * h)


def test_torch_style_sp_keeps_gathered_linear_inputs():
    s, b, h, a, t = 1024, 1, 4096, 32, 4
    items = gpt_layer_activations(s, b, h, a)
    megatron = activation_bytes(items, tp=t, sequence_parallel=True)
    dtensor = activation_bytes(items, tp=t, sequence_parallel=True, sp_regather=False)
    assert dtensor - megatron == pytest.approx(4 * s * b * h * (1 - 1 / t))


def test_invalid_region_and_checkpoint_are_named():
    with pytest.raises(ValueError, match="region"):
        SavedActivation("x", 1.0, "somewhere")
    with pytest.raises(ValueError, match="checkpoint"):
        activation_bytes([], checkpoint="half")
