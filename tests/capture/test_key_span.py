"""An attention core with a sliding window or chunk is priced by the band its mask leaves, not
the full causal triangle: capture records each attention module's key span (per layer kind), and
the cost model's attention work is the band's hand count."""
import pytest
import torch
import transformers

from autoplan.capture import capture
from autoplan.capture.key_span import key_span
from autoplan.search.units.work import module_work
from cost_models.compute import ATTENTION_CAUSAL, attention_time, causal_density
from cost_models.hardware import load_hardware

S, W = 4096, 1024
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


def _cores(cfg):
    """{attention module FQN: (key span, its fused attention entry)} of the model captured at (1, S)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.config._attn_implementation = "sdpa"
    g = capture(model, batch=(1, S))
    out = {}
    for n in g.nodes:
        if n.op == "aten.scaled_dot_product_attention.default":
            (entry,) = [e for e in module_work(g, n.module).gemms if e[4] == ATTENTION_CAUSAL]
            out[n.module] = (g.modules[n.module].key_span, entry)
    return out


def _pairs(entry) -> float:
    """Query-key pairs per head the entry is priced for: its FLOPs (torch's SDPA formula, the whole
    S x S matrix: 4 S^2 d forward, 2.5x that backward, per head of batch 1) times its density."""
    f, sq, sk, d, _, density = entry
    heads = f / (3.5 * 4 * sq * sk * d)
    return f * density / (3.5 * 4 * d * heads)


def test_mistral_window_is_the_band():
    cores = _cores(transformers.MistralConfig(**SHAPE, num_hidden_layers=2, sliding_window=W))
    assert cores
    for span, entry in cores.values():
        assert span == ("window", W)
        assert _pairs(entry) == pytest.approx(S * W - W * W / 2)   # not S^2 / 2


def test_gemma3_local_and_global_layers_each_their_own():
    cfg = transformers.Gemma3TextConfig(**SHAPE, head_dim=64, num_hidden_layers=6, sliding_window=W)
    cores = _cores(cfg)
    spans = {fqn: span for fqn, (span, _) in cores.items()}
    assert spans == {"model.layers.0.self_attn": ("window", W), "model.layers.5.self_attn": ()}
    assert _pairs(cores["model.layers.0.self_attn"][1]) == pytest.approx(S * W - W * W / 2)
    assert _pairs(cores["model.layers.5.self_attn"][1]) == pytest.approx(S * S / 2)


def test_no_window_unchanged():
    (span, entry), = _cores(transformers.LlamaConfig(**SHAPE, num_hidden_layers=2)).values()
    assert span == () and _pairs(entry) == pytest.approx(S * S / 2)
    hw = load_hardware("h100_sxm")
    f, sq, sk, d, _, density = entry
    peak = hw.peak("torch.bfloat16")
    assert attention_time(hw, peak, f, sq, sk, d, True, density) == attention_time(hw, peak, f, sq, sk, d, True)


def test_density_hand_counts():
    assert causal_density(S, S, ("chunk", W)) == pytest.approx(4 * W * W / 2 / S ** 2)   # Llama-4's chunks
    assert causal_density(S, S, ("window", 2 * S)) == 0.5                              # a window past S: causal
    assert causal_density(S, 2 * S, ("window", W)) == 1.0                              # cross-attention: whole


def _mask_of(span: tuple, s: int) -> torch.Tensor:
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    keep = k <= q
    if span and span[0] == "window":
        keep &= k > q - span[1]
    elif span and span[0] == "chunk":
        keep &= k // span[1] == q // span[1]
    return keep


SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=100)


@pytest.mark.parametrize("make", [
    lambda: transformers.MistralConfig(**SMALL, num_hidden_layers=1, sliding_window=16),
    lambda: transformers.Gemma3TextConfig(**SMALL, num_hidden_layers=6, sliding_window=16),
    lambda: transformers.Llama4TextConfig(**SMALL, intermediate_size_mlp=128, num_hidden_layers=4, num_local_experts=2,
                                          attention_chunk_size=16),
    lambda: transformers.GptOssConfig(**SMALL, num_hidden_layers=2, num_local_experts=2, num_experts_per_tok=1,
                                      sliding_window=16),
], ids=["mistral", "gemma3", "llama4", "gpt_oss"])
def test_key_span_is_the_mask_the_model_applies(make):
    """The span capture records for each layer is the mask the model really applies (eager, on CPU:
    the keys with nonzero attention weight), layer by layer."""
    torch.manual_seed(0)
    cfg = make()
    cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    s = 64
    with torch.no_grad():
        out = model(torch.randint(0, 100, (1, s)), output_attentions=True)
    spans = [key_span(layer.self_attn) for layer in model.model.layers]
    assert any(spans)
    for span, probs in zip(spans, out.attentions):
        assert torch.equal(probs[0, 0] > 0, _mask_of(span, s)), span
