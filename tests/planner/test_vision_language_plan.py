"""Capture and planning of a VL model: the repo's tiny VL model is captured with the vision
tower and the decoder as distinct block groups, each with attention and MLP roles; the planner gives
each its own TP strategies (the tower's q/k/v/o and fc1/fc2 sharded too) and verify's dry run issues
exactly the predicted collectives."""
from autoplan import MeshSpec, autoplan
from autoplan.capture import capture
from autoplan.models.vision_language import build_vision_language, vl_batch
from autoplan.verify import verify


def _model():
    return build_vision_language(deepstack_levels=1, n_layers=2)


def test_capture_sees_tower_and_decoder_blocks():
    model = _model()
    x, pv, _ = vl_batch(model, 2, 12)
    graph = capture(model, inputs=(x, pv))
    groups = {g.id: g for g in graph.blocks}
    assert set(groups) == {"layers", "visual.blocks"}
    vit = groups["visual.blocks"].roles
    assert vit["attention"][0]["projections"] == {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj",
                                                  "o": "attn.o_proj"}
    assert vit["mlp"][0]["up"] == "mlp.fc1" and vit["mlp"][0]["down"] == "mlp.fc2"


def test_plan_shards_tower_and_decoder_and_verifies():
    model = _model()
    x, pv, _ = vl_batch(model, 2, 12)
    plan = autoplan(model, MeshSpec((2,), ("tp",), "cpu"), inputs=(x, pv), allow_replicated_units=False)
    chosen = dict(zip(plan.summary()["unit"], plan.summary()["strategy"]))
    assert chosen["visual.blocks/attention"] == "heads_sharded"
    assert chosen["visual.blocks/mlp"] == "hidden_sharded"
    assert chosen["layers/attention"] == "heads_sharded"
    styles = plan.styles
    assert styles["visual.blocks.*.attn.q_proj"]["style"] == "ColwiseParallel"
    assert styles["visual.blocks.*.mlp.fc2"]["style"] == "RowwiseParallel"
    res = verify(plan, _model(), inputs=x)
    assert res.passed, res.mismatches()
    # the tower's two row-wise outputs per block (o_proj, fc2) all-reduce 2 x 4 patches x 16 wide fp32
    tower = res.collectives[(res.collectives["bytes"] == 512) & (res.collectives["phase"] == "forward")]
    assert int(tower["issued"].sum()) == 4
