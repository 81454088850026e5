"""Which models the planner pipelines is asked of the runtime's split: a stage runs the model's own
forward between its cuts (forward_split.py), so families nobody wrote an adapter for pipeline
(GPT-NeoX, Gemma-2: its forward scales the embedding and soft-caps the logits), and a model the
split cannot cut -- an encoder-decoder, whose decoder stages would need the encoder's output -- is
kept at pp=1 with the reason, and a pp constraint on it is refused with that reason."""
import pytest

from autoplan import plan_cluster
from autoplan.errors import InfeasiblePlanError
from autoplan.search.pipeline import support as pipeline_support
from autoplan.verify.corpus import real_model, seq_len
from hyper_parallel.core.pipeline_parallel import forward_split


@pytest.mark.parametrize("family,stacks", [("t5", "encoder.block, decoder.block"),
                                           ("bart", "model.encoder.layers, model.decoder.layers")])
def test_an_encoder_decoder_is_refused_naming_its_two_stacks(family, stacks):
    """GPT-NeoX, Gemma-2 and the other decoder families pipeline (the corpus slice runs them)."""
    model = real_model(family)
    with pytest.raises(InfeasiblePlanError, match=rf"constraints pp=2: .*2 block stacks \({stacks}\).*encoder-decoder"):
        plan_cluster(model, 4, hardware="h100_sxm", batch=(8, seq_len(model)), constraints={"pp": 2})


def test_an_encoder_decoder_is_planned_at_pp1_with_the_reason():
    model = real_model("bart")
    plan = plan_cluster(model, 8, hardware="h100_sxm", batch=(16, seq_len(model)), constraints={"tp": 1})
    assert dict(zip(plan.mesh["names"], plan.mesh["shape"]))["pp"] == 1
    assert any("pp=1 only" in n and "encoder-decoder" in n for n in plan.notes), plan.notes


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
def test_the_guard_sees_a_split_that_drops_sliding_windows(family, monkeypatch):
    """Issue 29: a split ran EXAONE-4's layers without their sliding window and the guard compared
    8 tokens, shorter than the window, so pipelined plans trained wrong gradients. The guard runs
    past every window/chunk the copy's config declares (windows shrunk to a few tokens), cut at
    every boundary, on a perturbed copy: a split whose stage-entry layers lose their masks (full
    causal attention) is refused with the gap it measured."""
    def unmasked(args, kwargs, slot, value):
        args, kwargs = real(args, kwargs, slot, value)
        return args, ({**kwargs, "attention_mask": None} if "attention_mask" in kwargs else kwargs)

    real = forward_split._with_slot
    monkeypatch.setattr(pipeline_support, "_GAPS", {})
    monkeypatch.setattr(forward_split, "_with_slot", unmasked)
    why = pipeline_support.pipeline_refusal(real_model(family))
    assert why is not None and "differs from its forward by" in why, why


@pytest.mark.parametrize("family", WINDOWED)
def test_the_split_runs_each_layer_with_its_own_mask(family, monkeypatch):
    """The stages run the model's forward, which builds each layer kind's mask (and RoPE table,
    Gemma-3): cut at every boundary, the copies are bit-equal past their windows."""
    from autoplan.verify.shrink import recipe_for

    model = real_model(family)
    small = recipe_for(model, [2]).build()
    length = pipeline_support.guard_length(small.config)
    windows = [v for k, v in small.config.to_dict().items() if k == "sliding_window"]
    assert windows and length > max(windows), (length, windows)
    monkeypatch.setattr(pipeline_support, "_GAPS", {})
    assert pipeline_support.pipeline_refusal(model) is None
    assert pipeline_support._small_copy_gap(model) == 0.0
