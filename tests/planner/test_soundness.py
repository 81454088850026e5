"""Every plan trains correctly or is refused: the probe's repairs and rejections, and verify's
numerics mode proving it can fail."""

import pytest
import torch
import torch.nn as nn

from autoplan import MeshSpec, autoplan
from autoplan.capture.blocks import nn_base
from autoplan.errors import InfeasiblePlanError
from autoplan.search.tp.probe import Prober, ProbeRun
from autoplan.verify import verify
from autoplan.verify.corpus import plan_case, real_model, small_recipe
from autoplan.verify.numerics import check_numerics
from hyper_parallel import ColwiseParallel
from tests.planner.models import GlobalHeadsAttention, TinyLM


@pytest.fixture(scope="module")
def qwen3_plan():
    return plan_case("qwen3", "dp2_tp2", "default")


def test_qwen3_default_plan_shards_and_repairs_qk_norms(qwen3_plan):
    _, plan = qwen3_plan
    styles = plan.styles
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert f"model.layers.*.self_attn.{proj}" in styles
    for norm in ("q_norm", "k_norm"):
        spec = styles[f"model.layers.*.self_attn.{norm}"]
        assert spec["style"] == "SequenceParallel" and spec["args"]["sequence_dim"] == 2, spec
    row = next(d for d in plan.decisions if d["unit"].endswith("/attention"))
    assert "q_norm" in row["reason"] and "gradients all-reduced" in row["reason"]
    # the repair's gradient reductions are predicted: one all-reduce per norm weight per block
    head_dim_bytes = 128 * 2  # bf16 weight of size head_dim
    ar = [c for c in plan.predictions["collectives"]
          if c["kind"] == "all_reduce" and c["phase"] == "backward" and c["bytes"] == head_dim_bytes]
    assert ar and ar[0]["count"] == 2 * 2  # q_norm + k_norm, 2 blocks


def test_qwen3_default_plan_equals_one_device_and_verify_catches_the_missing_reduction(qwen3_plan, pool4):
    model, plan = qwen3_plan
    good = verify(plan, model, numerics=True, pool=pool4)
    assert good.numerics.passed, good.numerics.summary()
    assert good.passed, good.mismatches()
    # the same plan with the q/k-norm gradient reduction removed by hand
    broken = plan.replace(styles={k: v for k, v in plan.styles.items()
                                               if not k.endswith(("q_norm", "k_norm"))})
    bad = check_numerics(broken, small_recipe("qwen3", model, [2, 2]), pool=pool4)
    assert not bad.passed and bad.error is None
    assert any("q_norm" in n for n in bad.bad_grads) and any("k_norm" in n for n in bad.bad_grads)


def test_a_plan_that_crashes_is_a_failed_verification_not_an_exception(qwen3_plan, pool4):
    model, plan = qwen3_plan
    # q_proj sharded but o_proj left whole: the attention output is a shard fed to a full Linear
    broken = plan.replace(styles={k: v for k, v in plan.styles.items() if not k.endswith("o_proj")})
    result = check_numerics(broken, small_recipe("qwen3", model, [2, 2]), pool=pool4)
    assert not result.passed and result.error


def test_global_reshape_attention_is_sharded_with_its_count_made_local():
    with torch.device("meta"):
        model = TinyLM()
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(8, 1024), dtype=torch.float32,
                    sequence_parallel=False)
    style = plan.styles["layers.*.attn"]
    assert style["style"] == "PrepareHeadsInput" and style["args"]["local_attributes"] == ["heads"], plan.styles
    assert plan.styles["layers.*.attn.q"] == ColwiseParallel().to_dict()
    assert any(n.startswith("layers.*.attn: heads_sharded") and "rejected" in n and "is invalid" in n
               for n in plan.notes), plan.notes


def test_global_reshape_attention_is_rejected_with_its_reason():
    """The count sits in an attribute whose name does not say it is one: nothing to make local."""
    with torch.device("meta"):
        model = TinyLM(count_name="n")
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(8, 1024), dtype=torch.float32,
                    sequence_parallel=False)
    assert not any(k.startswith("layers.*.attn.") for k in plan.styles), plan.styles
    assert any(n.startswith("layers.*.attn: heads_sharded") and "rejected" in n and "is invalid" in n
               for n in plan.notes), plan.notes
    with pytest.raises(InfeasiblePlanError, match=r"layers\.\*\.attn: cannot be tensor-parallel"):
        autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(8, 1024), dtype=torch.float32,
                 allow_replicated_units=False, sequence_parallel=False)


def test_layer_subclasses_count_as_their_torch_nn_base():
    class MyLinear(nn.Linear):
        pass

    class ScaledEmbedding(nn.Embedding):
        pass

    assert nn_base(MyLinear(2, 2)) == "torch.nn.modules.linear.Linear"
    assert nn_base(ScaledEmbedding(4, 2)) == "torch.nn.modules.sparse.Embedding"
    assert nn_base(nn.LayerNorm(2)) == ""


# Starcoder2 has 2 KV heads: tp=4 does not divide them, tp=2 does
@pytest.mark.parametrize("family,mesh,attention", [
    ("llama", "tp4", "heads_sharded"), ("qwen3", "tp4", "heads_sharded"), ("olmo2", "tp4", "heads_sharded"),
    ("gemma2", "tp4", "heads_sharded"), ("starcoder2", "dp2_tp2", "heads_sharded"), ("granite", "tp4", "heads_sharded"),
    ("mistral", "tp4", "heads_sharded"), ("phi3", "tp4", "heads_sharded_local")])
def test_default_plans_shard_attention_and_mlp(family, mesh, attention):
    _, plan = plan_case(family, mesh, "default")
    units = {d["unit"].split("/")[-1]: d["strategy"] for d in plan.decisions}
    assert units.get("attention") == attention, (family, units, plan.notes)
    assert units.get("mlp") == "hidden_sharded", (family, units, plan.notes)


def test_phi3_under_fsdp_keeps_packed_shards_and_verifies_exactly():
    """dp=2 x tp=2 with FSDP: Phi-3's packed [q|k|v] and [gate|up] weights are FSDP-sharded on
    dim 1 (their rows are a strided tensor-parallel shard); the dry run issues exactly the
    predicted FSDP bytes, and the exported snippet shards them the same way."""
    model, plan = plan_case("phi3", "dp2_tp2", "default")
    assert plan.fsdp.get("enabled")
    assert plan.styles["model.layers.*.self_attn.qkv_proj"] == {"style": "ColwiseParallel", "args": {"packed": 3}}
    assert plan.styles["model.layers.*.mlp.gate_up_proj"] == {"style": "ColwiseParallel", "args": {"packed": 2}}
    result = verify(plan, model)
    assert result.passed, result
    assert "shard_placement_fn=fsdp_shard_placement" in plan.to_python()


def test_corpus_real_models_are_meta():
    assert all(p.device.type == "meta" for p in real_model("qwen3").parameters())


class FoldingAttention(GlobalHeadsAttention):
    """Infers the *sequence* length and fixes the head count (OPT's ``view(b, -1, heads, hd)``):
    on a head shard this runs and silently folds heads into the sequence."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, -1, self.heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


def test_probe_sees_an_attention_core_that_is_not_head_sharded():
    """No crash and no parameter module sees a shard: only the attention core's input shape shows
    that heads were folded into the sequence."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.capture import capture
    from autoplan.search.tp.probe import Prober
    from hyper_parallel import ColwiseParallel, RowwiseParallel
    from hyper_parallel.local import fake_world

    with torch.device("meta"):
        model = TinyLM()
    for block in model.layers:
        block.attn.__class__ = FoldingAttention
    graph = capture(model, batch=(1, 64))
    prober = Prober(model, graph.blocks, 4, (1, 64), None)
    sharded = {f"layers.0.attn.{p}": ColwiseParallel() for p in "qkv"} | {"layers.0.attn.o": RowwiseParallel()}
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        prober.reference = prober.run({}, mesh)
        run = prober.run(sharded, mesh)
    assert run.error is None and prober.reference.cores
    found = prober.findings(run)
    assert any("attention core" in f.detail and f.dim is None for f in found), found


def test_bert_attention_is_sharded_and_verifies_exactly():
    """BERT's attention adds its input to its output inside the module (BertSelfOutput): the stream
    enters its heads at ``attention.self`` (q/k/v, not o), so the residual there stays a plain
    tensor and the heads share one annotated input; its decoder, tied to the word embeddings, is
    the LM head. Predicted collectives and parameter bytes equal the issued ones."""
    from autoplan import MeshSpec, autoplan
    from autoplan.verify import verify
    from autoplan.verify.corpus import real_model

    model = real_model("bert")
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(4, 512))
    kinds = {d["unit"].split("/")[-1]: d["strategy"] for d in plan.decisions}
    assert kinds["attention"] == "heads_sharded" and kinds["embedding"] == "vocab_sharded", kinds
    assert plan.styles["bert.encoder.layer.*.attention.self"]["style"] == "PrepareModuleInput"
    assert "cls.predictions.decoder" in plan.styles
    res = verify(plan, model)
    assert res.passed, res.mismatches()


def test_falcon_attention_and_mlp_are_sharded_and_verify_exactly():
    """Falcon (new decoder architecture): k/v reach the core through ``broadcast_to`` of a fused
    projection in KV groups (traced, sharded in whole groups with the head counts made local),
    and its block adds the attention output into the MLP output in place (the down projection
    returns a copy it may modify: ``owned_output``)."""
    from autoplan import MeshSpec, autoplan
    from autoplan.verify import verify
    from autoplan.verify.corpus import real_model

    model = real_model("falcon")
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(4, 2048))
    kinds = {d["unit"].split("/")[-1]: d["strategy"] for d in plan.decisions}
    assert kinds["attention"] == "heads_sharded_local" and kinds["mlp"] == "hidden_sharded_owned_output"
    assert plan.styles["transformer.h.*.mlp.dense_4h_to_h"]["args"]["owned_output"] is True
    res = verify(plan, model)
    assert res.passed, res.mismatches()


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_attention_is_sharded_and_verifies_exactly(family):
    """T5: the first block's attention computes a per-head position bias that every later block
    adds (read from the dataflow: ``structure.head_links``), so its bias table is sharded by heads
    with the projections and all linked attentions shard together. Both families: the decoder's
    cross-attention k/v projections each reduce the gradient of the encoder's states (predicted,
    and issued in the dry run -- which feeds the decoder as the runner does)."""
    from autoplan import MeshSpec, autoplan
    from autoplan.verify import verify
    from autoplan.verify.corpus import real_model

    model = real_model(family)
    plan = autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(4, 512))
    kinds = {d["unit"].split("/")[-1]: d["strategy"] for d in plan.decisions}
    assert kinds["attention"].startswith("heads_sharded") and kinds["cross_attention"].startswith("heads_sharded")
    assert kinds["mlp"] == "hidden_sharded"
    if family == "t5":
        assert len({d["unit"] for d in plan.decisions if d["unit"].endswith("attention")}) == 6
        assert any(k.endswith("relative_attention_bias") and v["style"] == "ColwiseParallel"
                   for k, v in plan.styles.items())
    res = verify(plan, model)
    assert res.passed, res.mismatches()


def test_gpt3_packed_qkv_bias_under_fsdp_stays_replicated_and_verifies_exactly():
    """dp=2 x tp=2 with FSDP: GPT-2-style modules (Conv1D, one packed [q|k|v] with a bias). The
    bias is strided-sharded by tp on its only dimension, so FSDP leaves it replicated and the
    runner averages its gradient in one all-reduce over dp: attention stays sharded, the dry run
    issues exactly the predicted rows (that all-reduce included) and the snippet says so."""
    model, plan = plan_case("gpt3", "dp2_tp2", "default")
    assert plan.fsdp.get("enabled")
    assert plan.styles["transformer.h.*.attn.c_attn"]["args"]["packed"] == 3
    rows = [r for r in plan.predictions["collectives"] if r["mesh_dim"] == "dp" and r["kind"] == "all_reduce"]
    assert rows and rows[0]["phase"] == "backward"
    result = verify(plan, model)
    assert result.passed, result
    assert "ignored_params=replicated" in plan.to_python()


def test_a_norm_annotated_as_a_shard_it_is_not_is_refused():
    """Bloom's embedding norm sits before the first block and sees the whole sequence: sequence
    parallel there would annotate the whole sequence as a shard (its weight gradients summed tp
    times). The planner keeps it off the stream norms (the stream is sharded at the first
    block), so a sequence-sharded plan never styles it; and the probe still refuses what would:
    a module given a DTensor whose global shape differs from the replicated run's."""
    _, plan = plan_case("bloom", "tp4", "forced_S")
    assert plan.stream_layout == "S"
    assert not any("word_embeddings_layernorm" in k for k in plan.styles), plan.styles
    prober = object.__new__(Prober)
    prober.reference = ProbeRun(inputs={"transformer.word_embeddings_layernorm": [(1, 2048, 4096)]})
    found = prober._global_shape_findings(ProbeRun(inputs={"transformer.word_embeddings_layernorm":
                                                           [("dtensor", 1, 8192, 4096)]}))
    assert found and "receives a DTensor of global shape (1, 8192, 4096)" in found[0].detail
