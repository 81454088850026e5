"""A model capture cannot trace: a typed CaptureError from capture, a data-parallel-only plan
(with the reason in its notes) from autoplan -- never a raw torch exception -- and for a model
that needs sharding a typed refusal naming the reason, never a plan that replicates it."""
import pytest
import torch
import torch.nn as nn

from autoplan import MeshSpec, autoplan, unsharded
from autoplan.capture import capture
from autoplan.errors import CaptureError, UnshardedPlanError
from tests.capture.test_image_inputs import mllama_images
from tests.capture.vl_families import build


class CountRouted(nn.Module):
    """Tokens grouped by expert with sizes read from the data (JetMoE's and many MoE kernels'
    form): neither export on meta nor an eager meta forward can size the groups."""

    def __init__(self, vocab=64, dim=32, experts=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids).flatten(0, 1)
        choice = self.router(x).argmax(-1)
        order = choice.argsort()
        sizes = torch.bincount(choice, minlength=len(self.experts)).tolist()
        parts = x[order].split(sizes)
        y = torch.cat([e(p) for e, p in zip(self.experts, parts)])
        return self.head(torch.empty_like(y).index_copy(0, order, y)).view(*ids.shape, -1)


def test_capture_failure_is_typed_and_names_the_model():
    with torch.device("meta"):
        model = CountRouted()
    with pytest.raises(CaptureError, match="CountRouted") as err:
        capture(model, batch=(2, 16))
    assert not type(err.value).__module__.startswith("torch")


@pytest.mark.parametrize("shape,names", [((4,), ("tp",)), ((2, 2), ("dp", "tp"))])
def test_untraceable_model_is_planned_data_parallel_only_with_the_reason(shape, names):
    with torch.device("meta"):
        model = CountRouted()
    plan = autoplan(model, MeshSpec(shape, names, "h100_sxm"), batch=(8, 16))
    assert plan.styles == {} and plan.pipeline is None
    assert plan.notes[0].startswith("capture could not trace CountRouted") and "data-parallel only" in plan.notes[0]
    assert plan.fsdp["enabled"] == ("dp" in names)
    assert plan.predictions["step_s"] > 0


def test_untraceable_model_that_needs_sharding_is_refused_naming_why(monkeypatch):
    """Above the stated size (here lowered to this model's) a tensor-parallel plan that would hold
    the whole model on every rank is refused, typed, naming the capture failure; so is one with
    replicated units forbidden. Data parallel (tp=1) stays a plan."""
    with torch.device("meta"):
        model = CountRouted()
    with pytest.raises(UnshardedPlanError, match="CountRouted needs sharding at tp=4 .*allow_replicated_units=False"):
        autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(8, 16), allow_replicated_units=False)
    monkeypatch.setattr(unsharded, "NEEDS_SHARDING_PARAMS", 1000)
    with pytest.raises(UnshardedPlanError, match="needs sharding at tp=4 .*parameters, above the 1,000.*could not trace"):
        autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(8, 16))
    assert autoplan(model, MeshSpec((4,), ("dp",), "h100_sxm"), batch=(8, 16)).fsdp["enabled"]


def test_traced_plan_that_shards_nothing_is_refused_when_sharding_is_needed(monkeypatch):
    """A traced model whose tp plan shards nothing (tensor parallelism does not pay on a tiny
    Mllama) is a plan below the stated size and a typed refusal above it, with the search's reason;
    a part no unit plans (its global transformer) is a note below it."""
    torch.manual_seed(0)
    model = build("mllama")
    model.extra_inputs = mllama_images
    mesh = MeshSpec((4,), ("tp",))
    plan = autoplan(model, mesh, batch=(2, 16))
    assert any(n.startswith("model.vision_model.global_transformer: kept replicated") for n in plan.notes)
    monkeypatch.setattr(unsharded, "NEEDS_SHARDING_PARAMS", 1000)
    with pytest.raises(UnshardedPlanError, match="needs sharding at tp=4 .* shards nothing: tensor parallelism does "
                                                 "not pay"):
        autoplan(model, mesh, batch=(2, 16))
