"""A MoE plan's memory as the runtime holds it (autoplan.search.experts.memory, mesh.dims.add_ep):
one layout's breakdown pinned against a count by hand from the model's config.

Mixtral-8x7B's layer shape, 2 layers, on 8 H100s as dp 2 x ep 4 with FSDP, one sequence of 1,024
tokens per micro-batch. Hand count (elements): experts 8 x 3 x 4096 x 14336 per layer, a rank
holds 8/4 of them, FSDP halves that; outside the experts the embedding and head (32000 x 4096
each), per layer q/o 4096 x 4096, k/v 4096 x 1024, the router 4096 x 8, two norms, and the final
norm. bf16 weights and gradients (2 bytes each), AdamW's fp32 master weights and two moments (12).
"""
from __future__ import annotations

import pytest
import torch

from autoplan.presets import build_preset
from autoplan.search.experts.search import OUR_EXPERT_RUNTIME, ExpertRuntime
from autoplan.search.mesh.search import ClusterSearch
from autoplan.search.experts.memory import expert_saved_bytes, memory_breakdown, norm_saved_bytes, routed_row_bytes

H, F, E, TOP_K, LAYERS, VOCAB, T = 4096, 14336, 8, 2, 2, 32000, 1024
DP, EP = 2, 4
EXPERT = LAYERS * (E // EP) * 3 * H * F // DP                     # per rank, after ep and FSDP
DENSE = 2 * VOCAB * H + LAYERS * (2 * H * H + 2 * H * 1024 + H * E + 2 * H) + H
# what a fused runtime (TE / Megatron-Core) saves per layer for one micro-batch, by hand
NORMS = 2 * T * (2 * H * 2 + 4)                                   # input + output (bf16) + fp32 1/rms, each
ATTENTION = T * (4096 + 1024 + 1024 + 4096) * 2 + T * 32 * 4      # q, k, v, o's input; fp32 lse per head
EXPERTS = T * TOP_K * (H + 2 * F) * 2 + T * TOP_K * (4 + 8)       # rows x (h + 2f), act recomputed; probs, ids
FUSED = ExpertRuntime(dedup=True, dense_state_over_ep=True, fused_saves=True, recompute_modules=("moe_act",),
                      source="test: a fused runtime sharding the non-expert state over dp x ep")


@pytest.fixture(scope="module")
def mixtral():
    model = build_preset("mixtral-8x7b", num_layers=LAYERS)
    model.config.use_cache = False
    return model


def _priced(model, runtime, graphs=None):
    search = ClusterSearch.of(model, DP * EP, hardware="h100_sxm", batch=(DP * EP, T), microbatch_sizes=(1,),
                           memory_limit=1e30, expert_runtime=runtime, graphs=graphs)
    cand = search.evaluate(dict(dp=DP, pp=1, tp=1, ep=EP), "1F1B", 1, "fsdp", "none", cuts="balanced", v=1)
    units, _ = search.unit_costs(DP, 1, 1, "fsdp", "none", 1, ep=EP)
    return search, cand, memory_breakdown(cand.choice, units, search.ctx(DP, 1, 1, "fsdp", "none", 1, EP))


def test_moe_layout_breakdown_matches_a_hand_count(mixtral):
    search, cand, mem = _priced(mixtral, FUSED)
    # state: experts over ep x dp, everything else over dp x ep (FSDP2 over dp_shard x ep)
    elements = EXPERT + DENSE / (DP * EP)
    assert mem.params == pytest.approx(2 * elements, rel=1e-6)
    assert mem.grads == pytest.approx(2 * elements, rel=1e-6)
    assert mem.optimizer == pytest.approx(12 * elements, rel=1e-6)
    # activations: the fused counts by hand, plus what neither changes (the router, residual adds,
    # the final norm and the head's input: captured)
    st = search.structure(1)
    g = search.moe_groups_at(1)[0]
    block = st.blocks[0]
    experts = search.meta.get_submodule(f"{g.block_prefix}.{g.indices[0]}.{g.rel}")
    ours_layer = block.norm_work.saved + block.attention.work.saved + \
        routed_row_bytes(experts, g.layout, TOP_K, search.dtype) * T * TOP_K
    _, _, ours = _priced(mixtral, OUR_EXPERT_RUNTIME, search.graphs)
    assert mem.activations == pytest.approx(ours.activations + LAYERS * (NORMS + ATTENTION + EXPERTS - ours_layer),
                                            rel=1e-6)
    assert mem.total == pytest.approx(max(cand.choice.rank_memory) + mem.buffers)
    assert (mem.inflight, mem.rank) == (1, 0)
    # the module functions say the same
    assert norm_saved_bytes(T, H, 2, 2) == NORMS
    assert expert_saved_bytes(T, TOP_K, H, F, 2, recompute_act=True) == EXPERTS


def test_our_runtime_shards_the_non_expert_state_over_dp_x_ep_under_fsdp(mixtral):
    """hyper_parallel's runtime under FSDP shards the experts over ep x dp and every other weight's
    state over the flattened dp x ep mesh (parallelisms.data.state_mesh), as FSDP2 over dp_shard x ep
    does; with replicated dp (no FSDP) the non-expert state stays whole on every rank, its gradients
    all-reduced over ep (ExpertGradSync)."""
    search, _, ours = _priced(mixtral, OUR_EXPERT_RUNTIME)
    assert ours.params == pytest.approx(2 * (EXPERT + DENSE / (DP * EP)), rel=1e-6)
    assert ours.optimizer == pytest.approx(12 * (EXPERT + DENSE / (DP * EP)), rel=1e-6)
    cand = search.evaluate(dict(dp=DP, pp=1, tp=1, ep=EP), "1F1B", 1, "replicate", "none", cuts="balanced", v=1)
    units, _ = search.unit_costs(DP, 1, 1, "replicate", "none", 1, ep=EP)
    rep = memory_breakdown(cand.choice, units, search.ctx(DP, 1, 1, "replicate", "none", 1, EP))
    assert rep.params == pytest.approx(2 * (EXPERT * DP + DENSE), rel=1e-6)


def test_dp1_fsdp_over_ep_still_shards_the_non_expert_state(mixtral):
    """AutoModel's "FSDP 8" at dp 1 x ep 8: the context prices dp=1 as "replicate" (nothing to shard
    over dp), but the plan asked for FSDP, so a runtime that shards over dp x ep shards over ep."""
    search = ClusterSearch.of(mixtral, EP * 2, hardware="h100_sxm", batch=(EP * 2, T), microbatch_sizes=(1,),
                           memory_limit=1e30, expert_runtime=FUSED)
    cand = search.evaluate(dict(dp=1, pp=1, tp=1, ep=2 * EP), "1F1B", 1, "fsdp", "none", cuts="balanced", v=1)
    units, _ = search.unit_costs(1, 1, 1, "fsdp", "none", 1, ep=2 * EP)
    mem = memory_breakdown(cand.choice, units, search.ctx(1, 1, 1, "fsdp", "none", 1, 2 * EP))
    assert search.ctx(1, 1, 1, "fsdp", "none", 1, 2 * EP).dp_mode == "replicate"
    assert mem.params == pytest.approx(2 * (LAYERS * 3 * H * F + DENSE / (2 * EP)), rel=1e-6)


def test_expert_parallel_saved_bytes_measured_on_meta_equal_a_real_run():
    """What ExpertParallel's forward keeps per routed copy, measured on a meta copy in the plan's
    dtype (what the planner uses, at the model's real widths), equals a real bf16 run of the same forward on a small
    Mixtral; by count it is the dispatched rows, fc1's output, the gate's and the product's
    outputs and the routed outputs it weights, (2 h + 4 f) x 2 bytes, plus per-row indices and
    weights -- one rows x h tensor more than transformers' own expert forward keeps."""
    import transformers
    from cost_models.saved_bytes import saved_storage_bytes
    from hyper_parallel.core.expert_parallel import ExpertParallel
    from hyper_parallel.core.expert_parallel.layouts import read_layout

    h, f, e, k, tokens = 64, 128, 4, 2, 32
    cfg = transformers.MixtralConfig(hidden_size=h, intermediate_size=f, num_hidden_layers=1, num_attention_heads=4,
                                     num_key_value_heads=2, num_local_experts=e, num_experts_per_tok=k, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    layout = read_layout(experts, "experts")
    x = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(tokens, k, dtype=torch.bfloat16, requires_grad=True)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)])
    skip = [x, w, *model.parameters()]
    style = ExpertParallel(ep_dim="")
    real, _ = saved_storage_bytes(lambda: style._forward(experts, layout, x, idx, w, 1, 0, 0, None, None), exclude=skip)
    hf, _ = saved_storage_bytes(lambda: experts(x, idx, w), exclude=skip)
    rows = tokens * k
    with torch.device("meta"):   # the planner's meta model keeps fp32 weights; the plan computes in bf16
        meta = transformers.AutoModelForCausalLM.from_config(cfg)
    per_row = routed_row_bytes(meta.model.layers[0].mlp.experts, layout, k, torch.bfloat16)
    assert per_row == pytest.approx(real / rows, rel=1e-3)   # balanced vs routed order: other index tensors
    assert (2 * h + 4 * f) * 2 < per_row < (2 * h + 4 * f) * 2 + 200
    assert real - hf == pytest.approx(rows * h * 2, abs=64)
