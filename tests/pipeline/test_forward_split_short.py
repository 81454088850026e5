"""The stage split's trace of a long stack through its first block (1.9 s of a first 70B
plan) reads the same split as the whole forward."""
from __future__ import annotations

import pytest
import torch
import transformers

import hyper_parallel.core.pipeline_parallel.forward_split as fs


def _hf(kind: str, **kw):
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(kind, **kw))


def _read(trace):
    return (trace.units, trace.blocks, trace.shared, trace.lead, trace.side,
            [(c.fqn, c.slot, c.out_leaves, str(c.out_spec)) for c in trace.calls])


@pytest.mark.parametrize("make", [
    lambda: _hf("gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=10, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256, sliding_window=8),
    lambda: _hf("gpt2", n_embd=64, n_layer=9, n_head=4, vocab_size=256, bos_token_id=0, eos_token_id=0),
], ids=["gemma2-10", "gpt2-9"])
def test_a_long_stack_traced_through_one_block_reads_the_whole_forwards_split(make, monkeypatch):
    with torch.device("meta"):
        model = make()
    fs._TRACES.clear()
    short = _read(fs.trace_forward(model))
    fs._TRACES.clear()
    monkeypatch.setattr(fs, "SHORTEN_FROM", 10 ** 9)
    assert short == _read(fs.trace_forward(model))
    fs._TRACES.clear()
