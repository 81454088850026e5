"""DeepSeek-V3's multi-head latent attention (MLA), planned at its published shape with its heads
sharded, applied to a small copy (a dense block and a MoE block, every parameter perturbed) and
stepped on 4 gloo ranks: one training step equals one device.

The hazard this guards: with heads sharded, the rotary key k_rot (columns kv_lora_rank: of
kv_a_proj_with_mqa's output) reaches every local head through ``expand`` without passing a
sharded projection, so each rank's gradient of it sums only its own heads. The loss stays equal;
kv_a_proj_with_mqa's weight gradient (and everything upstream of it) does not. PrepareLatentInput
all-reduces exactly those columns; the negative case below removes it and must fail.
"""
import types

import pytest
import torch.nn as nn

from autoplan.capture import capture
from autoplan.search.tp.strategies import attention_strategies
from autoplan.search.units.structure import model_structure

from autoplan.verify.corpus import plan_case, small_recipe
from autoplan.verify.dry_run import verify
from autoplan.verify.numerics import RTOL_LOSS, check_numerics
from hyper_parallel import PrepareLatentInput, Replicate
from hyper_parallel.errors import LayoutError, StyleSpecError
from tests.planner import latent_workers


def _without_broadcast_reduction(plan):
    """The plan with PrepareLatentInput replaced by a PrepareModuleInput of the same layouts."""
    styles = {}
    for pattern, spec in plan.styles.items():
        if spec["style"] == "PrepareLatentInput":
            spec = {"style": "PrepareModuleInput",
                    "args": {k: v for k, v in spec["args"].items() if not k.startswith("broadcast_")}}
        styles[pattern] = spec
    return plan.replace(styles=styles)


# DeepSeek-V3: a dense block and a MoE block (its shared experts are the MLP unit); V2-Lite's
# shape: q_proj instead of q_a/q_b, two dense blocks, forced onto a sequence-sharded stream
# (the module gathers the sequence at its input, o_proj reduce-scatters into it)
# (identical dense blocks are one block group: one unit each)
# (DeepSeek-V3 picks the sequence-sharded stream since its shared experts, inside the MoE container,
# take the container's gathered sequence)
@pytest.mark.parametrize("family,mesh,variant,stream,groups", [("deepseek_v3", "tp4", "default", "S", 2),
                                                               ("deepseek_v3", "dp2_tp2", "default", "S", 2),
                                                               ("deepseek_v2_lite", "tp4", "forced_S", "S", 1)])
def test_latent_attention_heads_sharded_equals_one_device(family, mesh, variant, stream, groups, pool4):
    model, plan = plan_case(family, mesh, variant)
    assert plan.stream_layout == stream
    picked = {d["unit"]: d["strategy"] for d in plan.decisions}
    attention = {u: s for u, s in picked.items() if u.endswith("/attention")}
    mlp = {u: s for u, s in picked.items() if u.endswith("/mlp")}
    assert len(attention) == groups and set(attention.values()) == {"heads_sharded_latent"}, picked
    assert len(mlp) == groups and set(mlp.values()) == {"hidden_sharded"}, picked
    latent = [s for s in plan.styles.values() if s["style"] == "PrepareLatentInput"]
    assert latent and all(s["args"]["broadcast_columns"] == ["kv_lora_rank", None] for s in latent)
    recipe = small_recipe(family, model, [d for d in plan.mesh["shape"] if d > 1])
    result = check_numerics(plan, recipe, pool=pool4)
    assert result.passed, result.summary()
    if stream == "S":   # the collectives it predicts (latent gradients included) are the ones issued
        dry = verify(plan, model)
        assert dry.passed, dry.mismatches()
    if (family, mesh) == ("deepseek_v3", "tp4"):
        broken = check_numerics(_without_broadcast_reduction(plan), recipe, pool=pool4)
        assert broken.error is None and not broken.passed, broken.summary()
        assert abs(broken.par_loss - broken.ref_loss) <= RTOL_LOSS * abs(broken.ref_loss)   # the loss cannot tell
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in broken.bad_grads, broken.bad_grads
        assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in broken.bad_grads, broken.bad_grads


def test_broadcast_columns_are_read_from_the_module_at_any_width():
    """The plan names the columns by the attribute the module's code cuts by, so the plan made at
    DeepSeek-V3's width (kv_lora_rank 512) applies to a small copy (16); bad specs are typed errors."""
    def attention(rank, rope):
        m = nn.Module()
        m.kv_lora_rank, m.config = rank, types.SimpleNamespace(kv_lora_rank=rank, name="x")
        m.kv_a_proj_with_mqa = nn.Linear(8, rank + rope)
        return m

    def style(columns, linear="kv_a_proj_with_mqa"):
        return PrepareLatentInput(input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=True,
                                  broadcast_linear=linear, broadcast_columns=columns)

    for rank, rope in ((512, 64), (16, 4)):
        assert style(["kv_lora_rank", None]).columns(attention(rank, rope)) == (rank, rank + rope)
        assert style(["config.kv_lora_rank", None]).columns(attention(rank, rope)) == (rank, rank + rope)
    assert style([2, 5]).columns(attention(16, 4)) == (2, 5)
    for bad in ([None, 3], ["kv lora", None], [3], [-1, None], "kv_lora_rank"):
        with pytest.raises(StyleSpecError):
            style(bad)
    with pytest.raises(StyleSpecError):
        style(["kv_lora_rank", None], linear="")
    for spec, linear in ((["kv_lora_rank", None], "kv_b_proj"), (["config.name", None], "kv_a_proj_with_mqa"),
                         (["kv_lora_rank", 99], "kv_a_proj_with_mqa"), ([4, 2], "kv_a_proj_with_mqa")):
        with pytest.raises(LayoutError):
            style(spec, linear).columns(attention(16, 4))


def test_latent_attention_saves_its_latents_whole_on_every_rank(pool4):
    """What a rank keeps for backward of a heads-sharded latent attention: the per-head tensors
    divided by tp, the latents (and what the down-projections save) whole. Measured on 4 gloo ranks
    beside one device, the per-rank share equals the planner's -- and is far from 1/tp, what the
    planner assumed before (at DeepSeek-V3's shape that priced the module's activations 2x too
    low at tp=8)."""
    model, plan = plan_case("deepseek_v3", "tp4", "default")
    recipe = small_recipe("deepseek_v3", model, [4])
    batch = (2, 16)
    block = model_structure(capture(recipe.build("meta"), batch=batch)).blocks[0]
    whole = block.attention.replicated_share[2]
    predicted = whole + (1 - whole) / 4
    latent = next(s for s in attention_strategies(block.attention, block, 4, "R") if s.name == "heads_sharded_latent")
    assert latent.activation_shard == pytest.approx(1 / predicted)
    ranks = pool4.run(latent_workers.attention_saved_bytes, plan.to_json(), recipe, "model.layers.0.self_attn", batch)
    for par, ref in ranks:
        assert par / ref == pytest.approx(predicted, rel=0.05), (par, ref, predicted)
        assert par / ref > 0.25 * 1.3, (par, ref)
