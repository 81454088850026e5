"""MPipe's runtime pieces in one process: a one-rank pipeline runs the tower through the same
PRE_F / PRE_B / REDUCE_PRE actions and equals one device; bad arguments fail early with typed errors
naming what is wrong."""
import pytest
import torch

from autoplan.models.vision_language import build_vision_language, vl_batch
from hyper_parallel.core.pipeline_parallel import Preprocess, Schedule1F1B, ScheduleZeroBubble, build_stages, mpipe
from hyper_parallel.core.pipeline_parallel.mpipe import PreprocessState
from hyper_parallel.errors import MicrobatchError, PipelineError, ScheduleError
from tests.pipeline.workers import lm_loss


@pytest.mark.parametrize("cls", [Schedule1F1B, ScheduleZeroBubble])
def test_one_rank_mpipe_equals_one_device(cls):
    ref = build_vision_language(deepstack_levels=1)
    x, pv, y = vl_batch(ref, 4, 12)
    lm_loss(ref(x, pv), y).backward()
    model = build_vision_language(deepstack_levels=1)
    stages = build_stages(model, cls.ir(1, 2))
    sched = cls(stages, 2, lm_loss, preprocess=Preprocess(model.visual, ("pixel_values",)))
    assert sched.ir.name.startswith("MPipe(")
    sched.step(x, target=y, pixel_values=pv)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), n


def test_bad_arguments_are_typed_errors():
    model = build_vision_language()
    with pytest.raises(PipelineError, match="inputs"):
        Preprocess(model.visual, "pixel_values")
    with pytest.raises(PipelineError, match="module"):
        Preprocess("visual", ("pixel_values",))
    with pytest.raises(PipelineError, match="specs name"):
        Preprocess(model.visual, ("pixel_values",), specs={"pixels": 0})
    pre = Preprocess(model.visual, ("pixel_values",))
    x, pv, y = vl_batch(model, 3, 12)
    with pytest.raises(MicrobatchError, match="do not divide"):
        PreprocessState.begin(pre, {"pixel_values": pv}, 2)     # 3 images into 2 micro-batches
    st = PreprocessState.begin(pre, {}, 2)
    with pytest.raises(MicrobatchError, match="pass them on every pipeline rank"):
        st.forward(0)
    stages = build_stages(model, Schedule1F1B.ir(1, 2))
    with pytest.raises(ScheduleError, match="preprocess=Preprocess"):
        Schedule1F1B(stages, 2, lm_loss, schedule=mpipe(Schedule1F1B.ir(1, 2)))
    with pytest.raises(PipelineError, match="must be a Preprocess"):
        Schedule1F1B(stages, 2, lm_loss, preprocess=model.visual)


def test_stage_zero_without_tower_output_names_the_fix():
    model = build_vision_language()
    x, pv, y = vl_batch(model, 2, 12)
    stages = build_stages(model, Schedule1F1B.ir(1, 1))
    with pytest.raises(Exception, match="run the tower with MPipe"):
        Schedule1F1B(stages, 1, lm_loss).step(x, target=y)
