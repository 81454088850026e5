"""Dry run of pipelined plans on a fake process group, EVERY pipeline rank: issued collectives ==
predicted per (kind, mesh dim, bytes) with counts -- TP of the rank's stages x micro-batches (the
last stage's vocabulary-parallel loss when the plan chose loss parallel), FSDP per unit (blocks
re-gathered whenever the schedule finds them resharded), P2P send+recv per boundary and
micro-batch, the runtime's signature all-reduce -- and parameter bytes per rank. Every schedule,
including those with two stages on a rank (Interleaved1F1B, ZBV)."""
import pytest
import torch
import transformers

from autoplan import autoplan, plan_cluster
from autoplan.errors import AutoplanError
from autoplan.verify.dry_run import verify
from autoplan.verify.pipeline_dry_run import verify_pipeline
from tests.search_pp.workers import build


def _plan(world, cons, model="llama_big_vocab", hardware="cpu", **kw):
    return plan_cluster(build(model, device="meta"), world, hardware=hardware, batch=(16, 16),
                        devices_per_node=world, constraints=dict(cons, fsdp=True), allow_replicated_units=False,
                        **kw)


def _logits_bytes(plan, vocab=4096):
    """Bytes of one micro-batch's full-vocabulary logits (fp32)."""
    return plan.pipeline["microbatch_size"] * plan.batch["seq_len"] * vocab * 4


@pytest.mark.parametrize("world,cons", [
    (4, {"pp": 2, "tp": 2, "dp": 1, "schedule": "GPipe", "microbatches": 4}),
    (4, {"pp": 2, "tp": 2, "dp": 1, "schedule": "1F1B", "microbatches": 4}),
    (4, {"pp": 2, "tp": 2, "dp": 1, "schedule": "Interleaved1F1B", "microbatches": 4}),
    (4, {"pp": 2, "tp": 2, "dp": 1, "schedule": "ZeroBubble", "microbatches": 4}),
    (4, {"pp": 2, "tp": 2, "dp": 1, "schedule": "ZBV", "microbatches": 4}),
    (8, {"pp": 2, "tp": 2, "dp": 2, "schedule": "ZeroBubble", "microbatches": 2}),
    (8, {"pp": 2, "tp": 2, "dp": 2, "schedule": "ZBV", "microbatches": 2}),
])
def test_every_rank_of_every_schedule_matches_predictions_exactly(world, cons):
    plan = _plan(world, cons)
    assert plan.pipeline["schedule"] == cons["schedule"]
    res = verify(plan, build("llama_big_vocab", device="meta"))
    assert res.passed, res.mismatches()
    df = res.collectives
    assert sorted(df["pp_rank"].unique()) == [0, 1]
    assert set(res.param_bytes["per_rank"]) == {0, 1}
    for r in (0, 1):
        kinds = set(df[(df["pp_rank"] == r) & (df["issued"] > 0)]["kind"])
        want = {"send_recv", "all_reduce"} | ({"all_gather", "reduce_scatter"} if cons["dp"] > 1 else set())
        assert want <= kinds, (r, kinds)


def test_last_rank_of_a_loss_parallel_plan_never_gathers_the_vocabulary():
    # priced for H100 in fp32: on this host's gloo profile the planner rightly gathers the logits
    plan = _plan(4, {"pp": 2, "tp": 2, "dp": 1, "schedule": "1F1B", "microbatches": 4}, hardware="h100_sxm",
                 dtype=torch.float32)
    assert plan.loss_parallel and plan.pipeline["stage_to_rank"][-1] == 1
    res = verify_pipeline(plan, build("llama_big_vocab", device="meta"), ranks=[1])
    assert res.passed, res.mismatches()
    last = res.collectives
    assert not ((last["kind"] == "all_gather") & (last["bytes"] >= _logits_bytes(plan)) & (last["issued"] > 0)).any()
    # the vocabulary-parallel loss's small fp32 reductions are what the last rank issues instead
    assert ((last["kind"] == "all_reduce") & (last["mesh_dim"] == "tp") & (last["bytes"] < 4096)).any()


def test_without_loss_parallel_the_gather_is_predicted_and_issued():
    plan = _plan(4, {"pp": 2, "tp": 2, "dp": 1, "schedule": "1F1B", "microbatches": 4}, model="llama")
    assert not plan.loss_parallel
    res = verify_pipeline(plan, build("llama", device="meta"), ranks=[1])
    assert res.passed, res.mismatches()
    gathers = res.collectives[res.collectives["kind"] == "all_gather"]
    assert (gathers["bytes"] == _logits_bytes(plan, vocab=128)).any()


def test_pipeline_verify_names_a_rank_that_does_not_exist():
    plan = _plan(4, {"pp": 2, "tp": 2, "dp": 1, "schedule": "GPipe", "microbatches": 4})
    with pytest.raises(AutoplanError, match="valid pipeline ranks are 0..1"):
        verify_pipeline(plan, build("llama_big_vocab", device="meta"), ranks=[2])


@pytest.mark.parametrize("schedule", ["1F1B", "ZBV"])
def test_hsdp_pipeline_plan_verifies_on_every_rank(schedule):
    """HSDP inside the stages: the dp_replicate all-reduces (one per reduce-scatter over dp, per
    pipeline rank) are predicted and issued exactly, beside FSDP's and the pipeline's traffic."""
    from autoplan.hsdp import to_hsdp

    sub = _plan(8, {"pp": 2, "tp": 2, "dp": 2, "schedule": schedule, "microbatches": 2})
    plan = to_hsdp(sub, 2, 32)
    res = verify(plan, build("llama_big_vocab", device="meta"))
    assert res.passed, res.mismatches()
    df = res.collectives
    for r in (0, 1):
        rep = df[(df["pp_rank"] == r) & (df["mesh_dim"] == "dp_replicate")]
        assert len(rep) and (rep["issued"] == rep["predicted"]).all() and set(rep["kind"]) == {"all_reduce"}


def test_bf16_fsdp_pipeline_plan_verifies_on_every_rank():
    """FSDP mixed precision inside pipeline stages: every rank's reduce-scatters carry fp32
    gradients (the rows of every pipeline rank are scaled, not only rank 0's) and the stages send
    activations in the dtype they compute in (bf16), as the runtime's boundary inference does
    (measured on 8 gloo ranks: send_recv 8192 B x 4 per rank, reduce-scatters at fp32 sizes)."""
    import torch

    plan = _plan(8, {"pp": 2, "tp": 2, "dp": 2, "schedule": "1F1B", "microbatches": 2}, dtype=torch.bfloat16)
    assert plan.fsdp["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    res = verify(plan, build("llama_big_vocab", device="meta"))
    assert res.passed, res.mismatches()
    df = res.collectives
    p2p = df[df["kind"] == "send_recv"]
    hidden = plan.pipeline["microbatch_size"] * plan.batch["seq_len"] * 64   # SMALL_LLAMA's width
    assert set(p2p["bytes"]) == {hidden * 2} and (p2p["issued"] == p2p["predicted"]).all()
    assert set(df[df["kind"] == "reduce_scatter"]["pp_rank"]) == {0, 1}


@pytest.mark.parametrize("cons", [{"pp": 1, "tp": 2, "dp": 2}, {"pp": 2, "tp": 2, "dp": 1}])
def test_one_layer_model_predicts_its_hidden_stream_and_verifies(cons):
    """A model whose one layer forms no block group: the embedding's all-reduce and the pipeline's
    sends carry the hidden stream (they were predicted as 0 bytes, and verify failed)."""
    from autoplan.models import build_llama
    from tests.planner.e2e_workers import SMALL_LLAMA

    model = build_llama(device="meta", **dict(SMALL_LLAMA, n_layers=1))
    plan = plan_cluster(model, 4, hardware="cpu", batch=(16, 16), devices_per_node=4,
                        constraints=dict(cons, fsdp=True))
    rows = plan.predictions["collectives"] + [r for rank in plan.pipeline.get("rank_collectives", []) for r in rank]
    assert not [r for r in rows if r["bytes"] == 0], rows
    res = verify(plan, model)
    assert res.passed, res.mismatches()


def test_one_stage_plan_with_microbatches_is_the_gradient_accumulation_the_runner_runs():
    """pp=1 priced as m micro-batches of b: the runner accumulates gradients over m micro-batches
    of b, so the plan says m micro-batches of b, its TP and FSDP rows x m, and verify matches it
    exactly (it was written as one pass of b*m while the runner had no accumulation)."""
    plan = _plan(4, {"pp": 1, "tp": 2, "dp": 2, "microbatches": 2})
    pipe = plan.pipeline
    assert (pipe["microbatches"], pipe["microbatch_size"]) == (2, 16 // 2 // 2)
    assert any("gradient accumulation" in n for n in plan.notes), plan.notes
    assert all(r["count"] % 2 == 0 for r in plan.predictions["collectives"])   # FSDP + TP: per micro-batch
    res = verify(plan, build("llama_big_vocab", device="meta"))
    assert res.passed, res.mismatches()


def test_split_backward_with_fsdp_predicts_repaired_norm_reductions_once():
    """Qwen3's per-head q/k norms see head-sharded activations: replicated weights whose gradients
    are all-reduced over tp. Under ZBV with FSDP the input pass (autograd.grad) never reaches a
    weight, so those reductions run once per micro-batch, in the weight pass -- the prediction
    used to count them twice (predicted 16, issued 8)."""
    import transformers

    def meta():
        with torch.device("meta"):
            return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
                vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=256, head_dim=64))

    plan = plan_cluster(meta(), 8, hardware="cpu", batch=(8, 32), devices_per_node=8, allow_replicated_units=False,
                        constraints={"pp": 2, "tp": 2, "dp": 2, "fsdp": True, "schedule": "ZBV", "microbatches": 2})
    res = verify(plan, meta())
    assert res.passed, res.mismatches()
    small = res.collectives[(res.collectives["kind"] == "all_reduce") & (res.collectives["bytes"] == 256)]
    assert len(small) and (small["issued"] > 0).all()


@pytest.mark.parametrize("cons", [{"pp": 2, "tp": 2, "schedule": "1F1B"},
                                  {"pp": 2, "dp": 2, "schedule": "1F1B", "dp_mode": "fsdp"},
                                  {"pp": 2, "dp": 2, "schedule": "1F1B", "dp_mode": "zero1"}],
                         ids=["tp2", "fsdp_dp2", "zero1_dp2"])
def test_a_head_tied_across_stages_is_predicted_where_the_runtime_keeps_it(cons):
    """GPT-2 cut in two: the last stage holds a copy of the tied embedding as its LM head, whose
    gradient the schedule sums over pp (and, left out of FSDP, averages over dp), and the first
    stage holds the position table no planner unit owns (it lives where it runs). Every rank's
    parameter bytes and collectives, and the head's stage's memory counts the copy."""
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=512, n_head=8, n_layer=4,
                                                                     vocab_size=32768, n_positions=512))
    plan = autoplan(model, 4, batch=(8, 512), constraints=cons)
    result = verify(plan, model)
    assert result.passed, (result.param_bytes, result.mismatches())
    per_rank = result.param_bytes["per_rank"]
    table = 32768 * 512 * (4 if cons.get("dp_mode") == "fsdp" else 2) // (2 if "tp" in cons else 1)
    assert per_rank[1]["issued"] > table    # the copy is on the last stage
    stages = plan.pipeline["per_stage"]
    assert stages[-1]["memory_bytes"] > 2 * table   # and in its memory: parameters and gradients at least
