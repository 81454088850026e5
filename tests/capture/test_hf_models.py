"""Real HF architectures (tiny configs) on meta: FLOPs vs FlopCounterMode, params, blocks, roles."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from autoplan.capture import capture, register_flop_formulas
from autoplan.capture.views import block_dataflow, distinct_ops

transformers = pytest.importorskip("transformers")

BATCH = (2, 16)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             num_hidden_layers=3, **IDS)


def _pair(config):
    torch.manual_seed(0)
    cpu = transformers.AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    return cpu, meta


def _reference_flops(model) -> int:
    register_flop_formulas()
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.zeros(BATCH, dtype=torch.long), use_cache=False)
    return counter.get_total_flops()


def test_llama_gqa_roles_and_flops():
    cpu, meta = _pair(transformers.LlamaConfig(**SMALL))
    g = capture(meta, batch=BATCH)
    assert g.total_flops() == _reference_flops(cpu)
    assert g.num_parameters == sum(p.numel() for p in cpu.parameters()) == g.traced_parameters()
    (block,) = g.blocks
    assert (block.prefix, block.count) == ("model.layers", 3)
    (att,) = block.roles["attention"]
    assert (att["n_heads"], att["n_kv_heads"], att["head_dim"]) == (4, 2, 16)
    assert att["projections"] == {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
                                  "o": "self_attn.o_proj"}
    (mlp,) = block.roles["mlp"]
    assert mlp["gated"] and (mlp["gate"], mlp["up"], mlp["down"]) == ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    assert g.roles["embedding"][0]["vocab"] == 128 and g.roles["lm_head"][0]["tied"] is False
    assert g.modules["model.layers.2.mlp.up_proj"].role == "mlp.up"


def test_mixtral_moe_router_and_experts():
    cfg = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    cpu, meta = _pair(cfg)
    g = capture(meta, batch=BATCH)
    assert g.total_flops() == _reference_flops(cpu)  # expert GEMMs counted in both (registered formula)
    (moe,) = g.blocks[0].roles["moe"]
    assert (moe["num_experts"], moe["top_k"], moe["router"]) == (4, 2, "mlp.gate")
    assert moe["experts"] == "mlp.experts" and len(moe["expert_params"]) == 2


def test_gpt2_fused_qkv_and_tied_head():
    cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=128, n_positions=32, **IDS)
    cpu, meta = _pair(cfg)
    g = capture(meta, batch=BATCH)
    assert g.total_flops() == _reference_flops(cpu)
    (att,) = g.blocks[0].roles["attention"]
    assert att["projections"] == {"qkv": "attn.c_attn", "o": "attn.c_proj"} and att["n_heads"] == 4
    assert g.roles["lm_head"][0]["tied"] is True
    assert ["lm_head.weight", "transformer.wte.weight"] in [sorted(t) for t in g.tied_parameters]
    assert g.num_parameters == sum(p.numel() for p in cpu.parameters())


def test_dataflow_exposes_functional_ops_between_modules():
    _, meta = _pair(transformers.LlamaConfig(**SMALL))
    g = capture(meta, batch=BATCH)
    steps = block_dataflow(g, g.blocks[0])
    roles = [s.role for s in steps if s.kind == "module"]
    assert roles == ["norm", "attention.q", "attention.k", "attention.v", "attention.o", "norm", "mlp.gate",
                     "mlp.up", "mlp.down"]
    ops = [s.op for s in steps if s.kind == "op"]
    assert "aten.scaled_dot_product_attention.default" in ops and "aten.silu.default" in ops
    sdpa = next(s for s in steps if s.op == "aten.scaled_dot_product_attention.default")
    assert sdpa.input_shapes[0] == (2, 4, 16, 16)
    distinct = distinct_ops(g)
    q = next(d for d in distinct if d.op == "aten.linear.default" and d.inputs[1].shape == (64, 64))
    assert q.count == 2 * 3  # q and o projections in each of 3 layers
    assert q.run("cpu").shape == (2, 16, 64)


def test_every_distinct_op_replays_on_cpu():
    """What the cost model profiles: each distinct op rebuilt from the IR runs on real tensors."""
    _, meta = _pair(transformers.LlamaConfig(**SMALL))
    g = capture(meta, batch=BATCH)
    for op in distinct_ops(g):
        args, kwargs = op.build("cpu", requires_grad=True)
        out = op.resolve()(*args, **kwargs)
        first = out[0] if isinstance(out, (tuple, list)) else out
        if isinstance(first, torch.Tensor):
            assert tuple(first.shape) == g.nodes[[n.name for n in g.nodes].index(op.example)].outputs[0].shape


def test_batch_spec_builds_images_and_decoder_tokens():
    vit = transformers.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                 image_size=32, patch_size=8)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(vit)
    g = capture(model, batch=(2, 1))
    assert [(i["name"], tuple(i["shape"])) for i in g.inputs] == [("pixel_values", (2, 3, 32, 32))]
    assert g.blocks[0].count == 2 and g.blocks[0].roles["attention"][0]["n_heads"] == 4

    t5 = transformers.T5Config(d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2, vocab_size=128, **IDS)
    with torch.device("meta"):
        model = transformers.AutoModelForSeq2SeqLM.from_config(t5)
    g = capture(model, batch={"batch_size": 2, "seq_len": 16, "decoder_seq_len": 8})
    assert {i["name"]: tuple(i["shape"]) for i in g.inputs} == {"input_ids": (2, 16), "decoder_input_ids": (2, 8)}
    assert sum(b.count for b in g.blocks) == 4  # encoder and decoder stacks
    cross = [a for b in g.blocks for a in b.roles.get("attention", []) if "EncDec" in a["module"]]
    assert cross and g.outputs[0]["shape"] == [2, 8, 128]


def test_sdpa_keeps_what_a_fused_kernel_keeps():
    _, meta = _pair(transformers.LlamaConfig(**SMALL))
    g = capture(meta, batch=BATCH)
    sdpa = next(n for n in g.nodes if n.op == "aten.scaled_dot_product_attention.default")
    assert sdpa.saves[-1] == sdpa.name and len(sdpa.saves) >= 4  # q, k, v (and mask), output
    b, h, s, _ = sdpa.inputs[0].shape
    assert sdpa.saved_internal_bytes == b * h * s * 4  # fp32 log-sum-exp, no (b, h, s, s) probabilities
