"""What the planner cannot read off a layer type is read off the runtime, and verify holds it to
that. Expert and Mamba styles shard parameters their own way (stacked experts on the ffn width, flat
expert rows strided per expert, a Mamba mixer's inner channels): a plan's per-rank parameter
bytes must come out as the runtime holds them, so the planner's memory check and FSDP traffic are
those of the model that runs. verify's dry run applies the plan on a fake process group and reads
the bytes off the sharded model."""
import pytest
import torch
import transformers

from autoplan import autoplan
from autoplan.capture import capture
from autoplan.search.pricing.sharding import param_shards
from autoplan.verify import verify
from hyper_parallel.parallel_dims import ParallelDims

CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        hidden_size=2048, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=512),
    "jamba": lambda: transformers.JambaConfig(
        hidden_size=2048, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
        num_experts=4, num_experts_per_tok=2, vocab_size=512, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("shape,names", [((4,), ("tp",)), ((2, 2), ("dp", "tp"))], ids=["tp4", "dp2_tp2"])
def test_expert_and_mamba_parameter_bytes_are_predicted_exactly(family, shape, names):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())
    dp = dict(zip(names, shape)).get("dp", 1)
    # Jamba's Mamba mixer runs its scan token by token without the CUDA kernels: a short sequence
    seq = 128 if family == "jamba" else 1024
    plan = autoplan(model, ParallelDims(shape, names, "h100_sxm"), batch=(4 * dp, seq), dtype=torch.bfloat16,
                    allow_replicated_units=False)
    kinds = {d["strategy"] for d in plan.decisions}
    assert "experts_tp" in kinds and (family != "jamba" or "channels_sharded" in kinds), kinds
    result = verify(plan, model)
    assert result.param_bytes["predicted"] == result.param_bytes["issued"], result.param_bytes


def test_a_style_that_says_how_it_shards_is_read_from_its_own_answer():
    """The planner's shapes-only count asks the style (ParallelStyle.param_shard_dims): the
    stacked experts' gate_up_proj [E, 2F, H] = [4, 8192, 2048] splits on 2F, down_proj [E, H, F] on F."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS["mixtral"]())
    plan = autoplan(model, ParallelDims((4,), ("tp",), "h100_sxm"), batch=(4, 1024), allow_replicated_units=False)
    graph = capture(model, batch=(4, 1024))
    shards = {s.fqn: s.local_shape for s in param_shards(graph, plan.styles, 4, ["model.layers"])}
    assert shards["model.layers.0.mlp.experts.gate_up_proj"] == (4, 2048, 2048)
    assert shards["model.layers.0.mlp.experts.down_proj"] == (4, 2048, 1024)


def test_a_repaired_norms_collectives_are_what_it_issues_alone():
    """OLMo-2's q/k norms normalise over the whole projected width, which head sharding cuts: the
    repair (SequenceParallel on that width) all-reduces per-token sums in forward and, in
    backward, all-gathers the weight gradient and reduce-scatters the whole input gradient. The
    whole-model probe cannot attribute backward collectives; the module run alone can, and the
    plan's predictions must equal what the dry run issues."""
    config = transformers.Olmo2Config(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=8, vocab_size=512)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    plan = autoplan(model, ParallelDims((4,), ("tp",), "h100_sxm"), batch=(4, 512), dtype=torch.bfloat16,
                    allow_replicated_units=False, sequence_parallel=False)
    attention = next(d for d in plan.decisions if d["unit"].endswith("attention"))
    assert "q_norm" in attention["reason"], attention["reason"]
    rows = {(r["kind"], r["phase"], r["bytes"]) for r in plan.predictions["collectives"]}
    assert ("reduce_scatter", "backward", 4 * 512 * 1024 * 4) in rows   # the fp32 input gradient of q_norm
    result = verify(plan, model)
    assert result.passed, result.mismatches().to_string()
