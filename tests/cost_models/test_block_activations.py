"""The Llama block activation model equals what autograd really saves (saved-tensor hooks)."""
import pytest
import torch

from autoplan.models.llama import build_llama
from cost_models.activations import activation_bytes, llama_block_activations
from cost_models.saved_bytes import saved_storage_bytes


@pytest.mark.parametrize("dtype,heads,kv", [(torch.float32, 4, 2), (torch.float32, 4, 4), (torch.bfloat16, 4, 1)])
def test_llama_block_saved_bytes(dtype, heads, kv):
    b, s, dim, ffn = 2, 32, 64, 96
    model = build_llama(n_layers=1, dim=dim, n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn, max_seq_len=s,
                        vocab_size=16).to(dtype)
    block = model.layers["0"]
    x = torch.randn(b, s, dim, dtype=dtype, requires_grad=True)
    rope = model.rope[:s].float()
    measured, _ = saved_storage_bytes(lambda: block(x, rope), exclude=list(block.parameters()))
    items = llama_block_activations(b, s, dim, heads, kv, ffn, act_bytes=dtype.itemsize, rope_table_elems=rope.numel())
    assert activation_bytes(items) == measured


def test_llama_layouts_divide_the_right_tensors():
    items = llama_block_activations(1, 1024, 4096, 32, 8, 14336, act_bytes=2)
    full = activation_bytes(items)
    tp = activation_bytes(items, tp=8)
    sp_megatron = activation_bytes(items, tp=8, sequence_parallel=True)
    sp_dtensor = activation_bytes(items, tp=8, sequence_parallel=True, sp_regather=False)
    assert full > tp > sp_dtensor > sp_megatron == pytest.approx(full / 8)
    assert activation_bytes(items, checkpoint="full") == 2 * 1024 * 4096  # the bf16 block input


def _single_device_block(seq=16):
    from tests.cost_models.workers import SMALL

    from cost_models.saved_bytes import saved_bytes_by_module

    model = build_llama(seed=0, **SMALL)
    block = model.layers["0"]
    x = torch.randn(2, seq, SMALL["dim"], requires_grad=True)
    per, _ = saved_bytes_by_module(lambda: block(x, model.rope[:seq]), block, replicated=[model.rope])
    return per


@pytest.mark.parametrize("plan", ["torchtitan", "megatron"])
def test_per_rank_activations_under_tp_plans_match_two_gloo_ranks(pool2, plan):
    from tests.cost_models.workers import MEGATRON_STYLES, TORCHTITAN_STYLES, measured_tp_block_activations

    from cost_models.activations import activations_from_modules

    measured = pool2.run(measured_tp_block_activations, plan)
    styles = TORCHTITAN_STYLES if plan == "torchtitan" else MEGATRON_STYLES
    items = activations_from_modules(_single_device_block(), styles, prefix="layers.0.")
    # torch DTensor keeps the all-gathered input of column-wise linears: sp_regather=False
    pred = activation_bytes(items, tp=2, sequence_parallel=plan == "torchtitan", sp_regather=False)
    assert measured[0] == measured[1]
    assert sum(measured[0].values()) == pred
    assert pred < activation_bytes(items)


def test_fake_tensors_measure_what_real_tensors_save():
    from autoplan.models.llama import LlamaConfig, TransformerBlock, rope_tables
    from cost_models.ops import fake_cpu
    from cost_models.saved_bytes import saved_bytes_by_module

    cfg = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=32)
    real_block = TransformerBlock(cfg)
    real, _ = saved_bytes_by_module(lambda: real_block(torch.randn(2, 32, 64, requires_grad=True),
                                                       rope_tables(16, 32, 1e4)), real_block)
    with fake_cpu():
        block = TransformerBlock(cfg)
        x = torch.empty(2, 32, 64, requires_grad=True)
        fake, _ = saved_bytes_by_module(lambda: block(x, rope_tables(16, 32, 1e4)), block)
    assert fake == real
