"""transformers' VL models pipelined end to end, as a user runs them.

Planned with ``autoplan(model, 4, constraints={"pp": 2, "tp": 2, ...})`` on meta at 32x the small
widths, applied to the small copy on 4 gloo ranks and trained one SGD step against one device
(loss rtol 1e-5, every gradient rtol 1e-4 / atol 1e-6, the tower's included): the tower on stage 0
and under MPipe. Then ``autoplan train`` on a ``save_pretrained`` directory under pp=2 x tp=2 with
images, resumed from its checkpoint: the resumed steps' losses equal the uninterrupted run's.
The family sweep (pp=2 and pp=4) is benchmarks/vl_pipelines.py."""
from __future__ import annotations

import csv
import shutil

import pytest
import torch

from autoplan import autoplan
from autoplan.capture.image_inputs import image_inputs
from autoplan.errors import InvalidConstraintError
from autoplan.verify.dry_run import verify
from autoplan.verify.numerics import check_numerics
from autoplan.verify.shrink import ModelRecipe
from hyper_parallel.core.pipeline_parallel.forward_split import STAGE_TOKENS
from hyper_parallel.core.pipeline_parallel.split import split_model
from tests.capture.vl_families import build
from tests.train import train_workers


def _plan(family: str, **constraints):
    with torch.device("meta"):
        wide = build(family, 32, 8)
    return autoplan(wide, 4, batch=(8, 512), constraints=constraints)


@pytest.mark.parametrize("family,placement", [("llava", "stage0"), ("gemma3", "mpipe"), ("qwen3_vl", "stage0"),
                                              ("qwen3_vl", "mpipe")])
def test_pipelined_vl_plan_equals_one_device(pool4, family, placement):
    """Qwen3-VL: its DeepStack levels and their mask cross the stage boundary behind the hidden
    state (carried.py), and under MPipe its levels of per-image lists cross from the tower's owner;
    its plans also verify exactly (stage 0's DeepStack adds index by the image-token mask)."""
    plan = _plan(family, pp=2, tp=2, tower_placement=placement)
    if family == "qwen3_vl":   # stage 0's layers add DeepStack features: the dry run indexes by the mask
        with torch.device("meta"):
            wide = build(family, 32, 8)
        result = verify(plan, wide)
        assert result.error is None and result.passed, (result.error, result.param_bytes, result.mismatches())
    pre = plan.pipeline["preprocess"]
    assert (pre["module"], pre["placement"]) == ("get_image_features", placement)
    assert any(("vision" in d["unit"] or "visual" in d["unit"]) and d["strategy"] != "replicate"
               for d in plan.decisions)
    # a stage boundary carries the decoder's stream (b, 512, 2048) in bf16, not the tower's (257 patches)
    sends = {r["bytes"] for r in plan.pipeline["rank_collectives"][0] if r["kind"] == "send_recv"}
    assert plan.pipeline["microbatch_size"] * 512 * 2048 * 2 in sends
    recipe = ModelRecipe(factory="tests.capture.vl_families:build", kwargs={"family": family, "image": 2}, seed=3)
    result = check_numerics(plan, recipe, pool=pool4, seq=40, global_batch=8)
    assert result.passed, result.summary()


def test_deepstack_levels_cross_a_stage_boundary_with_their_gradients():
    """A small Qwen3-VL cut before its first decoder layer: that layer, on stage 1, adds DeepStack
    level 0 at the image tokens. Stage 0 sends the level and the mask behind its hidden state
    (before: stage 1's forward had no tower output, skipped the add, and the guard measured a gap
    of 6.6), and the chained stages give the model's logits and every gradient -- the DeepStack
    merger's in the tower included -- as the whole model does."""
    torch.manual_seed(0)
    model = build("qwen3_vl", 1, 2)
    images = image_inputs(model)
    tokens = torch.randint(3, 256, (2, 8 + images.per_image), generator=torch.Generator().manual_seed(1))
    extra = dict(images(tokens))
    tokens = extra.pop("input_ids")
    want = model(tokens, **extra, use_cache=False).logits
    want.square().mean().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    first, second = split_model(model, ["model.language_model.layers.0"])
    sent = first(tokens, **extra, **{STAGE_TOKENS: tokens})
    assert [t.dtype for t in sent] == [torch.float32, torch.uint8, torch.uint8, torch.float32]   # h, header, mask, level
    got = second(*sent, **extra, **{STAGE_TOKENS: tokens})
    assert torch.equal(got, want)
    got.square().mean().backward()
    params = dict(model.named_parameters())
    assert any("deepstack_merger" in n for n in ref)
    assert [n for n, g in ref.items() if not torch.allclose(params[n].grad, g, rtol=1e-4, atol=1e-6)] == []


@pytest.mark.parametrize("family,placement", [("llava_next", "stage0"), ("llava_next", "mpipe"),
                                              ("paligemma", "stage0"), ("qwen2_vl", "mpipe")])
def test_verify_predicts_vl_pipelines_exactly(family, placement):
    """LLaVA-NeXT: a container's own parameter beside the tower (``image_newline``) lives with the
    tower (stage 0, or every rank's MPipe copy whose gradients are all-reduced over pp), and its
    tiled image inputs (``image_sizes`` as a list) still let the planner read off autograd which
    tower blocks run backward. MPipe's header is read on fake tensors as the tower laid it out.
    PaliGemma: the head tied to the embedding has a copy on the last stage (stage_params).
    Qwen2-VL: its tower cannot run on fake tensors (its attention splits by values), so the planner
    prices what ImageFeatures sends without running it -- the fixed-size header, then its per-image
    features as one tensor; before, one tensor was predicted where a header and one tensor per image
    crossed."""
    with torch.device("meta"):
        wide = build(family, 32, 8)
    plan = autoplan(wide, 4, batch=(8, 512), constraints={"pp": 2, "tp": 2, "tower_placement": placement})
    result = verify(plan, wide)
    assert result.passed, (result.param_bytes, result.mismatches())


def test_verify_predicts_qwen3_vl_carried_values_exactly():
    """Qwen3-VL at pp=4 under MPipe: stage 1 holds the layer that adds DeepStack level 0, so every
    boundary into a block carries the layout header, the image-token mask and the level behind the
    hidden state, forward and back (tower_plan.carried_rank_rows), and the tower's transposes hold
    the level beside its features. verify's dry run issues exactly those."""
    with torch.device("meta"):
        wide = build("qwen3_vl", 32, 8)
    plan = autoplan(wide, 4, batch=(8, 512), constraints={"pp": 4, "tower_placement": "mpipe"})
    assert plan.pipeline["cuts"][0] == "model.language_model.layers.0"
    result = verify(plan, wide)
    assert result.passed, (result.param_bytes, result.mismatches())


def test_verify_runs_qwen3_vl_deepstack_adds_at_tp4():
    """One stage running the decoder layers that add DeepStack features: transformers indexes the
    hidden states by the image-token mask (a nonzero, which fake tensors refuse). The dry run's token
    ids carry their values, so the mask's count is known (OwnRouting) and the step runs; the plan
    counts the tower's parameters exactly (its block groups were left out: 21 MB short). The pp=2
    plans are verified in test_pipelined_vl_plan_equals_one_device, on the plans it already makes."""
    with torch.device("meta"):
        wide = build("qwen3_vl", 32, 8)
    plan = autoplan(wide, 4, batch=(8, 512), constraints={"tp": 4, "pp": 1})
    result = verify(plan, wide)
    assert result.error is None, result.error
    assert result.passed, (result.param_bytes, result.mismatches())


def test_verify_predicts_the_tower_on_stage_0_exactly():
    """verify's dry run, every pipeline rank on a fake process group, with the step's images: the
    tower's TP all-reduces on stage 0's rank (its last CLIP layer, after LLaVA's feature layer,
    runs no backward), its parameters there, and the decoder's stream across the boundary."""
    with torch.device("meta"):
        wide = build("llava", 32, 8)
    plan = autoplan(wide, 4, batch=(8, 512), constraints={"pp": 2, "tp": 2, "tower_placement": "stage0"})
    result = verify(plan, wide)
    assert result.passed, result.mismatches()
    tower = result.collectives[(result.collectives.pp_rank == 0) & (result.collectives.bytes == 4 * 257 * 1024 * 2)]
    assert int(tower.issued.sum()) == 12   # 2 micro-batches x (2 layers forward + 1 backward) x 2


def test_a_placement_the_runtime_does_not_run_is_refused():
    with pytest.raises(InvalidConstraintError, match="own_stage.*runs \\['mpipe', 'stage0'\\]"):
        _plan("llava", pp=2, tp=2, tower_placement="own_stage")


def test_train_vl_pipelined_with_images_resumes(pool4, tmp_path):
    torch.manual_seed(0)
    build("llava", 1, 2).save_pretrained(tmp_path / "llava")

    def train(ckpt: str, metrics: str) -> list[dict]:
        out = pool4.run(train_workers.cli, ["train", "--model", str(tmp_path / "llava"), "--constraints", "pp=2,tp=2",
                                            "--steps", "6", "--batch", "8", "--seq", "40", "--lr", "2e-3",
                                            "--checkpoint-dir", str(tmp_path / ckpt), "--checkpoint-every", "3",
                                            "--metrics", str(tmp_path / metrics), "--progress", "none"])[0]
        assert out["rc"] == 0, out
        return list(csv.DictReader(open(tmp_path / metrics)))

    whole = train("a", "a.csv")
    assert [int(r["step"]) for r in whole] == list(range(1, 7))
    shutil.copytree(tmp_path / "a", tmp_path / "b", ignore=shutil.ignore_patterns("step-6*"))
    resumed = train("b", "b.csv")
    assert [int(r["step"]) for r in resumed] == [4, 5, 6]
    for got, want in zip(resumed, whole[3:]):
        assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-5)
