"""A pipelined plan of a model the runtime cannot cut into stages would fail at apply
(StageSplitError in split_model); the cluster search keeps such a model at pp=1 and says why,
and a pp constraint on it is refused with the runtime's reason."""
import pytest

from autoplan import plan_cluster
from autoplan.errors import InfeasiblePlanError
from autoplan.search import pipeline_support
from autoplan.verify.corpus import real_model, seq_len


@pytest.fixture(scope="module")
def neox():
    return real_model("gpt_neox")   # no spine adapter: gpt_neox.layers, not model.layers


def test_a_model_without_a_spine_is_planned_at_pp1_with_the_reason(neox):
    plan = plan_cluster(neox, 8, hardware="h100_sxm", batch=(16, seq_len(neox)), constraints={"tp": 1})
    assert dict(zip(plan.mesh["names"], plan.mesh["shape"]))["pp"] == 1
    assert all(a["name"].split("-")[1] == "pp1" for a in plan.alternatives), [a["name"] for a in plan.alternatives]
    assert any("pp=1 only" in n and "no spine adapter knows GPTNeoXForCausalLM" in n for n in plan.notes), plan.notes


def test_a_pp_constraint_on_it_is_refused_with_the_runtime_reason(neox):
    with pytest.raises(InfeasiblePlanError, match="constraints pp=2: .*no spine adapter knows GPTNeoXForCausalLM"):
        plan_cluster(neox, 4, hardware="h100_sxm", batch=(8, seq_len(neox)), constraints={"pp": 2})


def test_a_spine_that_computes_another_function_is_refused():
    """Gemma-2 matches the generic transformers decoder spine (embed_tokens, layers, norm,
    rotary_emb, lm_head) but scales its embedding and soft-caps its logits in its forward: cut into
    stages it stepped to another loss and other gradients (corpus, before this check). A small copy
    run both ways differs, so pipelining it is refused; Qwen3's copy is bit-equal and it pipelines."""
    gemma = real_model("gemma2")
    with pytest.raises(InfeasiblePlanError, match="'hf-causal-lm' spine runs Gemma2ForCausalLM's units in order"):
        plan_cluster(gemma, 4, hardware="h100_sxm", batch=(8, seq_len(gemma)), constraints={"pp": 2})
    qwen = real_model("qwen3")
    plan = plan_cluster(qwen, 4, hardware="h100_sxm", batch=(8, seq_len(qwen)), constraints={"pp": 2})
    assert plan.pipeline["pp"] == 2


def test_a_copy_that_cannot_be_checked_refuses_pipelining(monkeypatch):
    """The check builds a small copy from the config; if that fails, nothing is proven, so the
    model is not pipelined (and the planner does not crash)."""
    def broken(model):
        raise RuntimeError("no small copy")

    monkeypatch.setattr(pipeline_support, "_small_copy_gap", broken)
    monkeypatch.setattr(pipeline_support, "_GAPS", {})
    why = pipeline_support.pipeline_refusal(real_model("qwen3"))
    assert why is not None and "could not be checked" in why and "no small copy" in why


def test_nothing_fits_names_the_degrees_the_tp_search_refused():
    """allow_replicated_units=False at tp=1 leaves nothing to plan; the refusal says so instead of
    only "nothing fits N GiB" (46 corpus refusals read as a memory problem)."""
    llama = real_model("llama")
    with pytest.raises(InfeasiblePlanError, match="nothing fits .*; tp=1 refused: "):
        plan_cluster(llama, 4, hardware="h100_sxm", batch=(8, seq_len(llama)),
                     constraints={"pp": 2, "dp": 2, "tp": 1}, allow_replicated_units=False)


WINDOWED = ("exaone4", "mistral_swa", "gemma3")


@pytest.mark.parametrize("family", WINDOWED)
def test_the_guard_sees_a_spine_that_drops_sliding_windows(family, monkeypatch):
    """Issue 29: the spine ran EXAONE-4's layers without their sliding window and the guard
    compared 8 tokens, shorter than the window, so pipelined plans trained wrong gradients. The
    guard now runs past every window/chunk the copy's config declares (windows shrunk to a few
    tokens) on a perturbed copy: a spine that gives every layer the full causal mask is refused
    with the gap it measured (8.44 on EXAONE-4, 10.8 on Mistral with a window, where both were
    0.0 before); Gemma-3's copy fails to run that way (its RoPE is per layer kind): refused too."""
    from hyper_parallel.core.pipeline_parallel import split

    monkeypatch.setattr(pipeline_support, "_GAPS", {})
    monkeypatch.setattr(split, "_layer_kind", lambda config, fqn: "full_attention")
    why = pipeline_support.pipeline_refusal(real_model(family))
    assert why is not None and ("differs from its forward by" in why or "could not be checked" in why), why


@pytest.mark.parametrize("family", WINDOWED)
def test_the_spine_builds_each_layer_kind_its_mask(family, monkeypatch):
    """The spine builds the mask (and RoPE table, Gemma-3) of each layer's attention kind as the
    model's forward does, so these windowed models pipeline: their copies are bit-equal."""
    from autoplan.verify.shrink import recipe_for

    model = real_model(family)
    small = recipe_for(model, [2]).build()
    length = pipeline_support.guard_length(small.config)
    windows = [v for k, v in small.config.to_dict().items() if k == "sliding_window"]
    assert windows and length > max(windows), (length, windows)
    monkeypatch.setattr(pipeline_support, "_GAPS", {})
    assert pipeline_support.pipeline_refusal(model) is None
    assert pipeline_support._small_copy_gap(model) == 0.0
