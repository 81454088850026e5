"""Boundary descriptions computed in one process (``local_boundaries``, what a dry run hands the
schedule as ``boundary_metas``) equal what the stages really exchange, and a schedule given them
skips the exchange; ``loss_context`` wraps the loss and the last stage's backward."""
import contextlib

import torch

from hyper_parallel.core.pipeline_parallel import ScheduleGPipe, even_cuts, split_model
from hyper_parallel.core.pipeline_parallel.shape_inference import local_boundaries
from hyper_parallel.core.pipeline_parallel.stage import PipelineStage
from tests.planner.e2e_workers import build


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())


def test_local_boundaries_describe_every_stage_input():
    model = build("llama")
    cuts = even_cuts(model, 3)
    tokens = torch.randint(0, 128, (2, 16))
    metas = local_boundaries(model, cuts, None, [tokens], {}, device="cpu")
    assert sorted(metas) == [1, 2, 3]  # inputs of stages 1, 2 and the last stage's output
    h = tokens
    for s, stage in enumerate(split_model(model, cuts)):
        h = stage(h)
        assert [m.shape for m in metas[s + 1]] == [tuple(h.shape)], s
        assert metas[s + 1][0].dtype == h.dtype and metas[s + 1][0].placements is None


def test_schedule_uses_given_boundaries_and_loss_context():
    model = build("llama")
    cuts: list[str] = []  # one stage: no process group needed
    tokens = torch.randint(0, 128, (4, 16))
    targets = torch.randint(0, 128, (4, 16))
    entered = []

    @contextlib.contextmanager
    def ctx():
        entered.append(1)
        yield

    stages = [PipelineStage(m, 0, 1, device="cpu") for m in split_model(model, cuts)]
    given = {1: []}
    sched = ScheduleGPipe(stages, 2, _lm_loss, loss_context=ctx, boundary_metas=given)
    loss = sched.step(tokens, target=targets)
    ref = _lm_loss(build("llama")(tokens), targets)
    assert torch.allclose(loss, ref, rtol=1e-5)
    assert next(iter(sched._metas.values())) is given   # no inference ran
    assert len(entered) == 4  # loss and backward of each of 2 micro-batches
