"""Fused q/k/v attention, Conv1D and in-block MLPs as planner units: the capture reads how a
fused projection's output is cut, the structure makes it an attention unit, and the strategies
offer the column styles that give each rank whole heads (or none where they would be wrong)."""
import pytest
import torch
import transformers

from autoplan.capture import capture
from autoplan.search.pricing.sharding import _shard_dim
from autoplan.search.tp.strategies import PACKED_BIAS, attention_strategies, mlp_strategies, norm_strategies
from autoplan.search.units.structure import model_structure
from hyper_parallel.core.tensor_parallel.linear_styles import CONV1D
from torch.distributed.tensor import Shard

MODELS = {
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        hidden_size=64, num_attention_heads=8, intermediate_size=128, num_hidden_layers=2, vocab_size=128)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=64, n_head=8, n_layer=2, vocab_size=128, n_positions=64)),
    "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        hidden_size=64, n_head=8, n_layer=2, vocab_size=128)),
    "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        hidden_size=64, num_attention_heads=8, ffn_dim=128, num_hidden_layers=2, vocab_size=128,
        word_embed_proj_dim=64, max_position_embeddings=64)),
    "phi3": lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(
        hidden_size=64, num_attention_heads=8, num_key_value_heads=8, intermediate_size=128, num_hidden_layers=2,
        vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        vocab_size=128)),
}


@pytest.fixture(scope="module")
def structures():
    out = {}
    for name, build in MODELS.items():
        with torch.device("meta"):
            model = build()
        out[name] = model_structure(capture(model, batch=(2, 16), dtype=torch.float32))
    return out


@pytest.mark.parametrize("name,layout,groups,packed,strategy", [
    ("gpt_neox", "interleaved", 8, 1, "heads_sharded"),    # view(b, s, -1, 3 * head_dim): q, k, v of one head side by side
    # view(b, s, heads, 3, head_dim), and an ALiBi bias with heads folded into the batch: the heads
    # count made local and the bias cut to the rank's heads
    ("bloom", "interleaved", 8, 1, "heads_sharded_local"),
    ("gpt2", "concat", 0, 3, "heads_sharded"),             # Conv1D output split into [q|k|v]
])
def test_fused_attention_is_a_unit_with_its_layout(structures, name, layout, groups, packed, strategy):
    st = structures[name]
    assert not [w for w, why in st.not_units if "attn" in w or "attention" in w], st.not_units
    a = st.blocks[0].attention
    assert (a.qkv_layout, a.qkv_groups, a.linear) == (layout, groups, True)
    assert a.projections == [a.qkv] and a.q == ""
    offered = attention_strategies(a, st.blocks[0], 4, "R")
    sharded = [s for s in offered if s.name == strategy]
    assert len(sharded) == 1, [s.name for s in offered]
    assert sharded[0].styles[a.qkv].packed == packed
    assert set(sharded[0].styles) == {a.rel, a.qkv, a.o}
    assert (sharded[0].styles[a.rel].to_dict()["args"].get("folded_heads") is not None) == (name == "bloom")


def test_packed_qkv_bias_is_marked_fsdp_replicated_and_groups_must_divide(structures):
    st = structures["gpt2"]
    a = st.blocks[0].attention
    sharded = [s for s in attention_strategies(a, st.blocks[0], 4, "R") if s.name == "heads_sharded"]
    assert sharded and sharded[0].extra.get(PACKED_BIAS)   # FSDP leaves that bias replicated
    st = structures["gpt_neox"]
    a = st.blocks[0].attention
    a.qkv_groups = 6    # e.g. GQA groups not divisible by tp
    try:
        out = attention_strategies(a, st.blocks[0], 4, "R")
    finally:
        a.qkv_groups = 8
    assert [s.name for s in out] == ["replicate"] and "groups" in out[0].extra["tp_excluded"]


def test_unknown_fused_layout_is_not_guessed(structures):
    a = structures["gpt_neox"].blocks[0].attention
    a.qkv_layout = "unknown"
    try:
        out = attention_strategies(a, structures["gpt_neox"].blocks[0], 4, "R")
    finally:
        a.qkv_layout = "interleaved"
    assert [s.name for s in out] == ["replicate"]


def test_conv1d_layers_are_shardable_linears(structures):
    m = structures["gpt2"].blocks[0].mlp
    assert m.linear and m.hidden == 256
    assert _shard_dim("ColwiseParallel", CONV1D, "weight") == 1
    assert _shard_dim("ColwiseParallel", CONV1D, "bias") == 0
    assert _shard_dim("RowwiseParallel", CONV1D, "weight") == 0
    assert _shard_dim("RowwiseParallel", CONV1D, "bias") is None


def test_mlp_without_container_is_sharded_on_either_stream(structures):
    """fc1/fc2 directly in the block: on R, Megatron's f/g; on S the up linear gathers the
    sequence at its input and the down linear scatters it back (no replicated form on S: no
    module bounds the region) -- on dim 0, where OPT's block has flattened its tokens (read from
    the captured input shapes), as its final norm takes them; its attention's norm keeps dim 1."""
    blk = structures["opt"].blocks[0]
    m = blk.mlp
    assert m.rel == "" and m.up == ["fc1"] and m.down == "fc2"
    on_r = mlp_strategies(m, blk, 4, "R", [])
    sharded = [s for s in on_r if s.name == "hidden_sharded"]
    assert len(sharded) == 1 and set(sharded[0].styles) == {"fc1", "fc2"}
    assert [c.kind for c in sharded[0].collectives] == ["all_reduce", "all_reduce"]
    on_s = mlp_strategies(m, blk, 4, "S", [])
    assert [s.name for s in on_s] == ["hidden_sharded"]
    assert m.token_dim == 0 and blk.norm_token_dims == {"final_layer_norm": 0}, (m, blk.norm_token_dims)
    assert on_s[0].styles["fc1"].input_layouts == Shard(0) and on_s[0].styles["fc2"].output_layouts == Shard(0)
    norms = norm_strategies(blk.norms, 4, "S", [], blk.norm_token_dims)[0].styles
    assert norms["final_layer_norm"].sequence_dim == 0 and norms["self_attn_layer_norm"].sequence_dim == 1
    assert sorted((c.kind, c.phase) for c in on_s[0].collectives) == [
        ("all_gather", "backward"), ("all_gather", "forward"), ("reduce_scatter", "backward"),
        ("reduce_scatter", "forward")]


def test_reshape_by_the_global_head_count_is_sharded_only_with_the_count_made_local(structures):
    """OPT views q as (bsz, -1, num_heads, head_dim): on a column shard it would run and fold the
    missing heads into the sequence. The plain form is not offered (the unit says why); the form
    that makes the module's num_heads and embed_dim local is, and only that."""
    blk = structures["opt"].blocks[0]
    a = blk.attention
    assert a.fixed_head_count and a.head_attrs["num_heads"] == a.head_attrs["config.num_attention_heads"] == a.n_heads
    assert set(a.head_attrs) == {"num_heads", "config.num_attention_heads", "embed_dim"}
    out = attention_strategies(a, blk, 4, "R")
    assert [s.name for s in out] == ["replicate", "heads_sharded_local"]
    assert "global head count" in out[0].extra["tp_excluded"]
    assert out[1].styles[a.rel].local_attributes == ["config.num_attention_heads", "embed_dim", "num_heads"]
    a.head_attrs, saved = {}, a.head_attrs
    try:
        assert [s.name for s in attention_strategies(a, blk, 4, "R")] == ["replicate"]
    finally:
        a.head_attrs = saved
    assert not structures["gpt_neox"].blocks[0].attention.fixed_head_count


def test_packed_projections_mark_only_a_packed_bias_fsdp_replicated(structures):
    """FSDP2 shards a packed weight on its other dimension (fsdp_shard_placement); a packed bias
    has only one and stays replicated over dp (fsdp_unshardable): Phi-3 (no biases) has nothing
    to mark, GPT-2's biased c_attn is marked (the cluster search, which casts to bf16 under
    FSDP, leaves such options out there)."""
    phi = structures["phi3"].blocks[0]
    assert not phi.attention.qkv_bias and not phi.mlp.up_bias and phi.mlp.packed == 2
    names = [s.name for s in attention_strategies(phi.attention, phi, 4, "R")]
    assert "heads_sharded" in names or "heads_sharded_local" in names
    mlp = mlp_strategies(phi.mlp, phi, 4, "R", [])
    assert [s.name for s in mlp] == ["replicate", "hidden_sharded", "hidden_sharded_owned_output"]
    assert not mlp[1].extra.get(PACKED_BIAS) and mlp[2].extra["fallback_for"] == "hidden_sharded"
    gpt2 = structures["gpt2"].blocks[0]
    assert gpt2.attention.qkv_bias
    out = attention_strategies(gpt2.attention, gpt2, 4, "R")
    assert all(s.extra.get(PACKED_BIAS) for s in out if s.name != "replicate")


def test_latent_attention_is_a_unit_with_its_broadcast_columns(structures):
    """DeepSeek's MLA writes k into a new_empty buffer in place (k_nope from kv_b_proj, the rotary
    k_rot from columns kv_lora_rank: of kv_a_proj_with_mqa, broadcast to every head). The
    alias-aware dataflow follows those writes: the attention is a unit whose heads come from
    q_b_proj and kv_b_proj (k and v share it), with kv_a_proj_with_mqa's columns [16, 20) named
    as broadcast; its low-rank q_a -> q_b pair is no "MLP", its latent norms no stream norms, and
    the block's real MLP (dense or the MoE's shared experts) stays the MLP unit."""
    st = structures["deepseek_v3"]
    for b in st.blocks:
        a = b.attention
        assert (a.rel, a.q, a.k, a.v, a.o) == ("self_attn", "self_attn.q_b_proj", "self_attn.kv_b_proj",
                                               "self_attn.kv_b_proj", "self_attn.o_proj")
        assert (a.n_heads, a.n_kv_heads, a.linear) == (8, 8, True)
        assert a.broadcast == [("self_attn.kv_a_proj_with_mqa", 16, 20, 2 * 16 * 4 * 4)]
        assert a.proj_input_bytes == {"self_attn.q_b_proj": 2 * 16 * 32 * 4, "self_attn.kv_b_proj": 2 * 16 * 16 * 4}
        offered = {s.name: s for s in attention_strategies(a, b, 4, "R")}
        assert sorted(offered) == ["heads_sharded_latent", "replicate"]
        styles = offered["heads_sharded_latent"].styles
        latent = styles["self_attn"]   # inputs plain, the rotary key's columns named as the code names them
        assert (latent.broadcast_linear, latent.broadcast_columns, latent.use_local_output) == \
            ("kv_a_proj_with_mqa", ["kv_lora_rank", None], True)
        assert "self_attn.q_a_proj" not in styles and "self_attn.kv_a_proj_with_mqa" not in styles   # replicated
        assert attention_strategies(a, b, 3, "R")[0].extra["tp_excluded"].startswith("heads 8")
    assert [b.mlp.rel for b in st.blocks] == ["mlp", "mlp.shared_experts"]
    assert all(not any("q_a_layernorm" in n or "kv_a_layernorm" in n for n in b.norms) for b in st.blocks)
    assert not [w for w, why in st.not_units if "not recognised" in why], st.not_units
