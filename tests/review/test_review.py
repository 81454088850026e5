"""explain, diff, compare_plans, the per-stage table and the plots, on the 70B shape (2 layers)."""
from __future__ import annotations


import pytest

from autoplan import MeshSpec, Plan, autoplan, compare_plans
from autoplan.models.llama_plans import megatron_plan
from autoplan.presets import build_preset
from autoplan.review import plot_memory, save_figure, simulate_pipeline
from autoplan.importers import import_plan
from autoplan.review.explain import UnknownModuleError

MESH = MeshSpec((8, 8), ("dp", "tp"), "h100_sxm")
BATCH = (64, 8192)


@pytest.fixture(scope="module")
def plans():
    model = build_preset("titan-llama3-70b", num_layers=2)
    auto = autoplan(model, MESH, batch=BATCH)
    auto = auto.replace(model=dict(auto.model, plan_name="autoplan"))
    mega = import_plan(model, MESH, megatron_plan(), name="megatron", batch=BATCH)
    return auto, mega


def _pipeline(p: int, v: int = 1, schedule: str = "1F1B") -> dict:
    """A hand-made pipeline dict in the planner's format (per_stage rows)."""
    stages = p * v
    return {"pp": p, "stages": stages, "cuts": list(range(0, 2 * stages, 2)), "schedule": schedule,
            "virtual_stages": v, "microbatches": 8,
            "per_stage": [{"stage": s, "rank": s % p if v == 1 else s % p, "units": [2 * s, 2 * s + 2],
                           "compute_s": 0.6 + 0.05 * s, "comm_s": 0.02, "bubble_s": 0.2,
                           "memory_bytes": float((30 - s) * 2**30)} for s in range(stages)]}


def test_explain_module_gives_style_alternatives_and_why(plans):
    auto, _ = plans
    e = auto.explain("layers.7.feed_forward.w2")
    assert e.unit == "layers/mlp" and e.strategy == "hidden_sharded" and e.stream == "S"
    w2 = {"style": "RowwiseParallel", "args": {"output_layouts": "Shard(1)"}}
    assert e.styles == {"layers.*.feed_forward.w2": w2}
    t = e.options.set_index(["strategy", "stream"])
    assert t.loc[("hidden_sharded", "S"), "verdict"] == "chosen"
    assert t.loc[("replicate", "R"), "verdict"].startswith("slower by")
    assert "more compute" in t.loc[("replicate", "R"), "verdict"]
    assert "more communication" in t.loc[("sequence", "S"), "verdict"]   # replicated weights, gathered grads
    assert "residual stream R" in t.loc[("hidden_sharded", "R"), "verdict"]
    assert (t["delta_s"] >= -1e-12).all()   # nothing cheaper was left on the table
    assert "uses 'hidden_sharded'" in e.text and "slower by" in str(e)


def test_explain_unit_names_and_unknown(plans):
    auto, _ = plans
    head = auto.explain("head")
    assert head.strategy == "loss_parallel" and "output" in head.styles
    gather = head.options[head.options["strategy"] == "vocab_sharded_gather"]
    assert gather["verdict"].str.contains("more communication").all()
    assert auto.explain("layers/attention").unit == auto.explain("attention").unit == "layers/attention"
    assert auto.explain("layers").unit.startswith("layers/")      # a container maps to its first unit
    with pytest.raises(UnknownModuleError, match="'nope' is neither a unit"):
        auto.explain("nope")


def test_diff_contents(plans):
    auto, mega = plans
    assert auto.diff(auto).empty
    assert auto.diff(Plan.from_json(auto.to_json())).empty
    d = auto.diff(mega)
    assert list(d.columns) == ["section", "key", "a", "b", "change"]
    rows = {(r.section, r.key): r for r in d.itertuples()}
    assert rows[("setting", "stream_layout")].a == "S" and rows[("setting", "stream_layout")].b == "R"
    assert rows[("style", "norm")].a == "SequenceParallel(reduce_grads=True)" and rows[("style", "norm")].change == "removed"
    assert rows[("style", "layers.*.attention.wo")].a == "RowwiseParallel(output_layouts=Shard(1))"
    assert rows[("decision", "head")].b == "vocab_sharded_gather [R]"
    step = rows[("prediction", "step_s")]
    assert step.b > step.a and step.change.startswith("+")
    assert ("collective_bytes", "reduce_scatter/tp/forward") in rows
    assert ("mesh", "mesh") not in rows


def test_diff_sees_mesh_and_pipeline(plans):
    auto, _ = plans
    other = auto.replace(mesh=dict(auto.mesh, hardware="b200"), pipeline=_pipeline(2))
    d = auto.diff(other).set_index(["section", "key"])
    assert d.loc[("mesh", "hardware"), "b"] == "b200"
    assert d.loc[("pipeline", "pp"), "b"] == 2 and d.loc[("pipeline", "schedule"), "change"] == "added"


def test_compare_plans(plans):
    auto, mega = plans
    t = compare_plans([auto, mega])
    assert list(t.index) == ["autoplan", "megatron"]
    assert t.loc["autoplan", "vs_best"] == 1.0 and t.loc["megatron", "vs_best"] > 1.2
    assert t.loc["autoplan", "tokens_per_s"] == pytest.approx(64 * 8192 / auto.step_time)
    assert t.loc["autoplan", "devices"] == 64 and t.loc["autoplan", "mesh"] == "dp8xtp8"
    assert t.loc["megatron", "mem_activations_gib"] > t.loc["autoplan", "mem_activations_gib"]
    named = compare_plans({"a": auto, "b": mega}, strategies=True)
    assert list(named.index) == ["a", "b"] and named.loc["b", "unit:head"] == "vocab_sharded_gather[R]"
    assert list(compare_plans([auto, auto]).index) == ["autoplan#0", "autoplan#1"]


def test_stage_table_without_and_with_pipeline(plans):
    auto, _ = plans
    one = auto.stage_table()
    assert len(one) == 1 and one.loc[0, "compute_s"] == pytest.approx(auto.predictions["compute_s"])
    piped = auto.replace(pipeline=_pipeline(4))
    t = piped.stage_table()
    assert list(t["stage"]) == [0, 1, 2, 3] and t.loc[3, "memory_gib"] == pytest.approx(27.0)
    assert t["busy_fraction"].between(0, 1).all()


@pytest.mark.parametrize("p,v,schedule", [(4, 1, "1F1B"), (2, 2, "Interleaved1F1B"), (2, 2, "ZBV")])
def test_timeline_from_the_simulator(plans, tmp_path, p, v, schedule):
    piped = plans[0].replace(pipeline=_pipeline(p, v, schedule))
    sim = simulate_pipeline(piped)
    assert sorted(sim.timeline["rank"].unique()) == list(range(p))
    assert sum(sim.busy) == pytest.approx(sum(0.6 + 0.05 * s for s in range(p * v)))   # every stage's compute
    assert sim.step_time >= max(sim.busy) and 0 < sim.bubble_fraction < 1
    path = save_figure(piped.plot_timeline(), tmp_path / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_and_communication_plots(plans, tmp_path):
    auto, mega = plans
    fig = plot_memory([auto, mega], limit_bytes=80 * 2**30)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["capacity", "params", "grads", "optimizer",
                                                                   "activations"]
    stacked = sum(bar.get_height() for bar in ax.patches[::2])       # bars of the first plan
    assert stacked == pytest.approx(auto.predictions["memory_bytes"]["total"] / 2**30, rel=1e-6)
    piped = auto.replace(pipeline=_pipeline(4))
    assert len(piped.plot_memory().axes[0].patches) == 4              # one bar per pipeline rank
    comm = auto.plot_communication()
    labels = [t.get_text() for t in comm.axes[0].get_legend().get_texts()]
    assert labels == ["mesh dim dp", "mesh dim tp"]
    for name, f in (("mem", fig), ("comm", comm)):
        assert save_figure(f, tmp_path / f"{name}.png").stat().st_size > 5000


def test_module_table(plans):
    auto, _ = plans
    t = auto.module_table().set_index("module")
    assert set(t.index) == set(auto.styles)
    assert t.loc["layers.*.attention", "input_layouts"] == "Shard(1), - -> Replicate(), -"
    assert t.loc["layers.*.attention.wo", "output_layouts"] == "Shard(1)"
    assert t.loc["layers.*.feed_forward.w1", "unit"] == "layers/mlp"
    assert t.loc["output", "strategy"] == "loss_parallel"


def test_explain_a_replicated_unit_by_module_name():
    """Units kept replicated have no styles; a module FQN still finds them, with the reason."""
    from autoplan.demo import DEMO_MODEL
    from autoplan.models import build_llama

    plan = autoplan(build_llama(device="meta", **DEMO_MODEL), MESH, batch=(64, 64))   # 4 KV heads, tp 8
    e = plan.explain("layers.0.attention")
    assert e.unit == "layers/attention" and e.strategy == "replicate" and e.styles == {}
    assert any("KV heads 4 not divisible by tp=8" in n for n in e.notes)
    assert not e.options["verdict"].str.startswith("excluded").any()
    units = {q: plan.explain(q).unit for q in ("layers.1.ffn_norm", "layers.1.attention_norm", "layers.1.feed_forward",
                                               "norm", "output", "tok_embeddings")}
    assert units == {"layers.1.ffn_norm": "layers/norms", "layers.1.attention_norm": "layers/norms",
                     "layers.1.feed_forward": "layers/mlp", "norm": "final_norm", "output": "head",
                     "tok_embeddings": "embedding"}


def test_stage_table_and_timeline_of_a_real_pipeline_plan(tmp_path):
    """plan_cluster with pp=2: the table names each stage's modules and the simulator replays
    the plan's schedule within the exposed data-parallel time of the predicted step."""
    from autoplan.cluster import plan_cluster
    from autoplan.review.stages import _compact

    assert _compact(["tok_embeddings", "layers.0", "layers.1", "layers.3", "norm"]) == \
        "tok_embeddings, layers.0-1, layers.3, norm"
    model = build_preset("titan-llama3-70b", num_layers=4)
    plan = plan_cluster(model, 32, batch=(32, 4096), constraints={"pp": 2, "tp": 8})
    t = plan.stage_table()
    pipe = plan.pipeline
    assert len(t) == pipe["pp"] * pipe.get("virtual_stages", 1) and set(t["rank"]) == {0, 1}
    assert t.iloc[0]["units"].startswith("tok_embeddings, layers.0") and t.iloc[-1]["units"].endswith("norm, output")
    sim = simulate_pipeline(plan)
    assert sim.schedule == plan.pipeline["schedule"]
    assert sim.step_time <= plan.step_time * 1.001 and sim.step_time >= 0.8 * plan.step_time
    assert save_figure(plan.plot_timeline(), tmp_path / "t.png").stat().st_size > 5000
    assert len(plan.plot_memory().axes[0].patches) == 2
