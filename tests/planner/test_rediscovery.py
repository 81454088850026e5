"""The planner rediscovers the expert plans (torchtitan / Megatron-LM with sequence parallel)."""
import pytest

from autoplan import MeshSpec, autoplan
from autoplan.models import build_llama
from tests.planner import models

BATCH_PER_DP = 8
SEQ = 4096


def classify(plan) -> dict[str, str]:
    """Per role, the style class the plan gives it -- the level at which plans are 'equal up to
    equivalences' (e.g. an embedding that reduce-scatters vs one that all-reduces then slices)."""
    out = {}
    for d in plan.decisions:
        if d["unit"] != "entry":  # where the sequence is first sharded: an equivalence
            out[d["unit"].split("/")[-1]] = d["strategy"]
    out["stream"] = plan.stream_layout
    return out


EXPERT = {"attention": "heads_sharded", "mlp": "hidden_sharded", "norms": "sequence", "final_norm": "sequence",
          "embedding": "vocab_sharded", "head": "loss_parallel", "stream": "S"}


def _styles_by_suffix(plan) -> dict[str, str]:
    return {k.split(".")[-1]: v["style"] for k, v in plan.styles.items()}


CASES = [
    ("repo_llama_8b", models.repo_llama_8b, 4, ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2"),
     ("attention_norm", "ffn_norm", "norm")),
    ("repo_llama_8b", models.repo_llama_8b, 8, ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2"),
     ("attention_norm", "ffn_norm", "norm")),
    ("hf_llama_8b", models.hf_llama_8b, 4, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
     ("o_proj", "down_proj"), ("input_layernorm", "post_attention_layernorm", "norm")),
    ("hf_llama_8b", models.hf_llama_8b, 8, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
     ("o_proj", "down_proj"), ("input_layernorm", "post_attention_layernorm", "norm")),
    ("hf_qwen2_7b", models.hf_qwen2_7b, 4, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
     ("o_proj", "down_proj"), ("input_layernorm", "post_attention_layernorm", "norm")),
    ("hf_qwen2_72b", models.hf_qwen2_72b, 8, ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
     ("o_proj", "down_proj"), ("input_layernorm", "post_attention_layernorm", "norm")),
]


@pytest.mark.parametrize("name,make,tp,col,row,norms", CASES, ids=[f"{c[0]}-tp{c[2]}" for c in CASES])
def test_rediscovers_expert_plan_on_h100(name, make, tp, col, row, norms):
    dp = 8
    plan = autoplan(make(), MeshSpec((dp, tp), ("dp", "tp"), "h100_sxm"), batch=(dp * BATCH_PER_DP, SEQ))
    assert classify(plan) == EXPERT, (name, tp, classify(plan), plan.alternatives)
    styles = _styles_by_suffix(plan)
    for m in col:
        assert styles[m] == "ColwiseParallel", (m, styles)
    for m in row:
        assert styles[m] == "RowwiseParallel", (m, styles)
    for m in norms:
        assert styles[m] == "SequenceParallel", (m, styles)
    head = [v for k, v in plan.styles.items() if k in ("output", "lm_head")][0]
    assert head["style"] == "ColwiseParallel" and head["args"].get("use_local_output") is False
    assert plan.loss_parallel
    assert plan.solver["status"] == "Optimal"
    # the chosen plan is at least as good as every priced alternative
    assert all(plan.step_time <= a["step_s"] * (1 + 1e-9) for a in plan.alternatives)


def test_gpt3_shape_with_fused_qkv_rediscovers_megatron_at_tp8():
    """Megatron's GPT-3 plan (column-parallel fused QKV and fc1, row-parallel projections, vocab-
    parallel embedding and loss, sequence-parallel norms) on GPT-2's modules: [q|k|v] is one
    Conv1D split by the global width, so each rank takes its slice of q, k and v (packed=3) and the
    attention's split size and head count are made local."""
    plan = autoplan(models.hf_gpt3_175b(), MeshSpec((8,), ("tp",), "h100_sxm"), batch=(8, 2048))
    assert classify(plan) == dict(EXPERT, attention="heads_sharded_local"), (classify(plan), plan.notes)
    styles = plan.styles
    assert styles["transformer.h.*.attn.c_attn"] == {"style": "ColwiseParallel", "args": {"packed": 3}}
    assert styles["transformer.h.*.mlp.c_fc"] == {"style": "ColwiseParallel", "args": {}}
    for proj in ("attn.c_proj", "mlp.c_proj"):
        assert styles[f"transformer.h.*.{proj}"]["style"] == "RowwiseParallel"
    assert set(styles["transformer.h.*.attn"]["args"]["local_attributes"]) >= {"num_heads", "split_size"}
    for norm in ("transformer.h.*.ln_1", "transformer.h.*.ln_2", "transformer.ln_f"):
        assert styles[norm]["style"] == "SequenceParallel", norm
    assert styles["transformer.wte"]["style"] == "RowwiseParallel" and plan.loss_parallel


def test_repo_llama_reproduces_torchtitan_styles_exactly():
    """For the repo Llama (the torchtitan module names) the emitted styles are torchtitan's, as the
    runners apply both (a SequenceParallel reduces its weight gradients in backward: the plan says
    so explicitly, torchtitan's leaves torch's default)."""
    from autoplan.models.llama_plans import torchtitan_plan
    from autoplan.parallelisms.tensor import runner_styles

    plan = autoplan(models.repo_llama_8b(), MeshSpec((8, 8), ("dp", "tp"), "h100_sxm"), batch=(64, SEQ))
    titan = {k: v.to_dict() for k, v in torchtitan_plan(loss_parallel=True).items()}
    assert runner_styles(plan.styles) == runner_styles(titan)


def test_hf_llama_shards_sequence_at_first_block_not_embedding():
    """HF derives positions and masks from the embedding output, so the sequence split must
    happen at the first decoder layer (the stream's entry: autoplan/search/tp/stream_entry.py)."""
    plan = autoplan(models.hf_llama_8b(), MeshSpec((8, 8), ("dp", "tp"), "h100_sxm"), batch=(64, SEQ))
    assert plan.styles["model.embed_tokens"]["args"].get("output_layouts", "Replicate()") == "Replicate()"
    entry = plan.styles["model.layers.0"]
    assert entry["style"] == "PrepareModuleInput"
    assert entry["args"]["desired_input_layouts"] == ["Shard(1)"]


def test_too_small_model_stays_replicated_and_says_why():
    tiny = build_llama(device="meta", dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=128, ffn_hidden=128)
    plan = autoplan(tiny, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(2, 64))
    assert plan.styles == {}
    assert any("does not pay" in n for n in plan.notes), plan.notes
    rep = [a for a in plan.alternatives if a["name"] == "replicated"][0]
    assert plan.step_time == pytest.approx(rep["step_s"])


def test_kv_heads_fewer_than_tp_keep_attention_replicated():
    model = build_llama(device="meta", dim=4096, n_layers=2, n_heads=32, n_kv_heads=4, vocab_size=32000,
                        ffn_hidden=14336, max_seq_len=4096)
    plan = autoplan(model, MeshSpec((8, 8), ("dp", "tp"), "h100_sxm"), batch=(64, SEQ))
    cls = classify(plan)
    assert cls["attention"] == "replicate" and cls["mlp"] == "hidden_sharded"
    assert any("KV heads" in n for n in plan.notes), plan.notes
