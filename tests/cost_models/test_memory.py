"""Per-rank parameter/gradient/optimizer bytes, pipeline in-flight micro-batches, memory breakdown."""
import pytest

from autoplan.models import build_llama
from cost_models.memory import (ParamSpec, chunk_size, inflight_microbatches, model_state_bytes, param_specs,
                                rank_memory, tp_shard_dim)
from hyper_parallel.errors import UnknownScheduleError
from tests.cost_models.workers import SMALL, TORCHTITAN_STYLES, measured_fsdp_state_bytes, measured_state_bytes


def test_state_bytes_match_torch_tp_plan_on_two_ranks(pool2):
    measured = pool2.run(measured_state_bytes)
    specs = param_specs(build_llama(device="meta", **SMALL), TORCHTITAN_STYLES)
    for m in measured:
        pred = model_state_bytes(specs, tp=2, tp_rank=m["rank"], precision="fp32")
        assert (pred.params, pred.grads, pred.optimizer) == (m["params"], m["grads"], m["optimizer"])
    # the odd vocabulary really is split unevenly: rank 0 holds more than rank 1
    assert measured[0]["params"] > measured[1]["params"]
    # and DTensor's vocab-sharded embedding gradient is full size: the model must say so
    megatron = param_specs(build_llama(device="meta", **SMALL), TORCHTITAN_STYLES, runtime="megatron")
    assert model_state_bytes(megatron, tp=2, tp_rank=0).grads < measured[0]["grads"]


def test_state_bytes_match_fsdp2_on_two_ranks(pool2):
    measured = pool2.run(measured_fsdp_state_bytes)
    specs = param_specs(build_llama(device="meta", **SMALL))
    for m in measured:
        pred = model_state_bytes(specs, fsdp=2, fsdp_rank=m["rank"], precision="fp32")
        assert (pred.params, pred.grads, pred.optimizer) == (m["params"], m["grads"], m["optimizer"])
        exact = model_state_bytes(specs, fsdp=2, fsdp_rank=m["rank"], fsdp_padded=False)
        assert exact.params == m["params_unpadded"]
    assert measured[1]["params_unpadded"] < measured[1]["params"]  # the odd vocabulary pads rank 1


def test_param_specs_follow_style_conventions():
    specs = {p.fqn: p for p in param_specs(build_llama(device="meta", **SMALL), TORCHTITAN_STYLES)}
    assert specs["layers.0.attention.wq.weight"].tp_dim == 0
    assert specs["layers.0.attention.wo.weight"].tp_dim == 1
    assert specs["tok_embeddings.weight"].tp_dim == 0          # row-wise embedding shards the vocabulary
    assert specs["layers.1.ffn_norm.weight"].tp_dim is None
    assert tp_shard_dim("ColwiseParallel", "embedding", "weight") == 1
    assert tp_shard_dim("rowwise", "linear", "bias") is None


def test_chunks_follow_torch_chunk():
    import torch

    for dim in (1, 5, 7, 64, 129):
        for parts in (1, 2, 3, 4, 8):
            got = [chunk_size(dim, parts, r) for r in range(parts)]
            want = [c.numel() for c in torch.arange(dim).chunk(parts)] + [0] * parts
            assert got == want[:parts]


def test_precision_policies_give_textbook_bytes_per_param():
    specs = [ParamSpec("w", (1000, 1000))]
    def per_param(pol):
        s = model_state_bytes(specs, precision=pol)
        return (s.total - 4) / 1e6  # minus AdamW's one step counter
    assert per_param("fp32") == 16
    assert per_param("zero_fp16") == 16   # ZeRO: 2 + 2 + 12
    assert per_param("megatron_bf16") == 18
    fsdp = model_state_bytes(specs, fsdp=8, precision="fp32")
    assert fsdp.params == 125 * 1000 * 4


def test_inflight_microbatches_per_schedule():
    """The runtime's counts (schedule_facts), which agree with the literature where it applies."""
    assert inflight_microbatches("GPipe", 4, 16) == 16
    assert [inflight_microbatches("1F1B", 4, 16, s) for s in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches("1F1B", 4, 2) == 2
    assert inflight_microbatches("Interleaved1F1B", 4, 16, 0, virtual=2) == pytest.approx(4 * (1 + 3 / 8))
    assert inflight_microbatches("ZBV", 4, 16, 3) == 4
    with pytest.raises(ValueError, match="stage"):
        inflight_microbatches("1F1B", 4, 16, 4)
    with pytest.raises(UnknownScheduleError, match="1F1B"):   # the old lowercase names are gone
        inflight_microbatches("1f1b", 4, 16)


def test_rank_memory_breakdown_adds_up():
    specs = [ParamSpec("w", (64, 64), tp_dim=0)]
    mem = rank_memory(specs, layer_activation_bytes=1000.0, n_layers=2, tp=2, fsdp=2,
                      inflight=inflight_microbatches("1F1B", 4, 8), largest_layer_params=2048,
                      precision="fsdp2_bf16")
    assert mem["activations"] == 1000.0 * 2 * 4
    assert mem["params"] == 16 * 64 * 4
    assert mem["fsdp_gathered"] == 2048 * 2 * 2
    assert mem["total"] == pytest.approx(mem[["params", "grads", "optimizer", "activations", "fsdp_gathered"]].sum())
