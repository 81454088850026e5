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
