"""A user's extra_inputs hook -- a processor's outputs: image tokens, pixels, the grid or the image
sizes, built on the tokens' device -- captures on meta as the derived inputs do. The hook used to
run on meta tokens and hand the tower a grid or sizes without values (Qwen2-VL's
repeat_interleave of its grid, LLaVA-NeXT's tiling of a zero image size), so those families were
planned data-parallel only with the hook and sharded without it."""
from __future__ import annotations

import pytest
import torch

from autoplan.capture import capture
from autoplan.capture.image_inputs import HookInputs, image_inputs
from autoplan.capture.opaque import OPAQUE
from autoplan.plan.forward import forward_tokens, output_logits
from tests.capture.vl_families import build, build_with_hook


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava_next", "mistral3"])
def test_a_processor_hook_captures_like_the_derived_inputs(family):
    with torch.device("meta"):
        hooked, derived = build_with_hook(family, 2, 2), build(family, 2, 2)
    assert isinstance(image_inputs(hooked), HookInputs)
    with_hook, without = capture(hooked, batch=(2, 64)), capture(derived, batch=(2, 64))
    assert with_hook.method != OPAQUE and not with_hook.method.startswith("hooks"), with_hook.warnings
    assert {g.prefix: g.count for g in with_hook.blocks} == {g.prefix: g.count for g in without.blocks}
    tower = [m for m in with_hook.modules if m.startswith(("model.visual.", "model.vision_tower."))]
    assert tower and any(with_hook.nodes_in(m) for m in tower)


def test_the_hook_runs_as_given_on_real_tokens():
    """Only a forward without values gets the completed inputs; a real step runs the hook's own."""
    torch.manual_seed(0)
    model = build_with_hook("qwen2_vl")
    tokens = torch.randint(3, 199, (2, 12))
    made = image_inputs(model)(tokens)
    assert set(made) == {"input_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids"}
    assert output_logits(forward_tokens(model, tokens)).shape == (2, 12, 256)
