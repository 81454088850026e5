"""Context parallelism in the planner: the ``cp`` registry entry's plan section and checks, the
price of cp on a fixed mesh (activations / cp, attention work, the exchange on the cp link),
exact dry runs at world 64, and plans that apply on gloo and equal one device."""
import json
import math

import pytest
import torch

from autoplan import MeshSpec, autoplan
from autoplan.errors import InvalidArgumentError, PlanSchemaError
from autoplan.plan import Plan
from autoplan.parallelisms.registry import PARALLELISMS, traffic_owners
from autoplan.verify.dry_run import verify
from tests.planner import cp_workers, e2e_workers
from autoplan.capture import capture
from autoplan.context_search import context_meshes, plan_context
from autoplan.models import build_llama
from autoplan.search.context.cost import cp_structure
from autoplan.search.units.structure import model_structure
from tests.planner.models import repo_llama_8b


def _plan(model_name, shape, names, hardware="cpu", batch=(4, 16), **opts):
    model = e2e_workers.build(model_name, device="meta")
    return autoplan(model, MeshSpec(shape, names, hardware), batch=batch, dtype=torch.float32, **opts)


def test_cp_entry_order_section_and_round_trip():
    order = [p.name for p in PARALLELISMS]
    assert order.index("tp") < order.index("cp") < order.index("ac") < order.index("dp")
    plan = _plan("llama", (2, 2), ("dp", "cp"))
    cp = plan.parallel["cp"]
    assert cp["dim"] == "cp" and cp["degree"] == 2 and cp["variant"] in ("ring", "allgather")
    back = Plan.from_json(plan.to_json())
    assert back.parallel["cp"] == cp and back.predictions == plan.predictions
    # FSDP over the flattened dp x cp mesh: owned by dp; the attention exchange by cp
    owners = traffic_owners(plan)
    assert owners["cp"] == "cp" and owners["dp_cp"] == "dp"
    rows = plan.predictions["collectives"]
    assert {r["mesh_dim"] for r in rows} == {"cp", "dp_cp"}
    assert {"kind": "all_reduce", "mesh_dim": "dp_cp", "phase": "forward", "bytes": 16, "count": 1} in rows  # the loss
    assert any("ring exchange is priced as overlapped" in n for n in plan.notes)


def _mutated(plan, fn):
    data = json.loads(plan.to_json())
    fn(data)
    return json.dumps(data)


def test_cp_section_checks():
    plan = _plan("llama", (2,), ("cp",))
    bad = {
        "null section on a cp mesh": lambda d: d["parallel"].update(cp=None),
        "unknown variant": lambda d: d["parallel"]["cp"].update(variant="zigzag"),
        "wrong dim": lambda d: d["parallel"]["cp"].update(dim="tp"),
        "sequence not divisible by 2cp": lambda d: d["batch"].update(seq_len=18),
        "degree disagrees with the mesh": lambda d: d["parallel"]["cp"].update(degree=4),
    }
    for why, fn in bad.items():
        with pytest.raises(PlanSchemaError, match="parallel/cp"):
            Plan.from_json(_mutated(plan, fn))
        assert why
    with pytest.raises(PlanSchemaError, match="flattened"):  # rows may name dp_cp, never an unknown dimension
        Plan.from_json(_mutated(plan, lambda d: d["predictions"]["collectives"][0].update(mesh_dim="cp_x")))


def test_autoplan_cp_argument_errors():
    with pytest.raises(InvalidArgumentError, match="2\\*cp = 4"):
        _plan("llama", (2,), ("cp",), batch=(4, 18))
    model = e2e_workers.build("hf_llama", device="meta")
    model.config.is_causal = False
    with pytest.raises(InvalidArgumentError, match="causal"):
        autoplan(model, MeshSpec((2,), ("cp",), "cpu"), batch=(4, 16))


def test_cp_pricing_on_a_fixed_mesh():
    """A Llama shape (2 layers, GQA, 128-wide heads) at 1K tokens: cp=4 x tp=2 against tp=2 alone --
    activations per rank fall cp-fold, attention FLOPs per rank are exactly 1/cp of the causal
    total (load-balanced chunks), and the ring exchange is priced on the cp link, mostly hidden
    behind the attention blocks."""
    model = build_llama(device="meta", dim=1024, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=32000,
                        ffn_hidden=3584, max_seq_len=1024)
    seq, cp = 1024, 4
    base = autoplan(model, MeshSpec((2,), ("tp",)), batch=(1, seq), activation_checkpointing=False,
                    sequence_parallel=True)
    plan = autoplan(model, MeshSpec((cp, 2), ("cp", "tp")), batch=(1, seq), activation_checkpointing=False,
                    sequence_parallel=True)
    for k in ("params", "grads", "optimizer"):   # FSDP over cp alone (no dp dimension): states / cp
        assert plan.predictions["memory_bytes"][k] == pytest.approx(base.predictions["memory_bytes"][k] / cp, rel=1e-3)
    assert plan.fsdp["enabled"] and plan.dp_dim is None
    act0, act = (p.predictions["memory_bytes"]["activations"] for p in (base, plan))
    assert 0.2 * act0 <= act <= 0.3 * act0, (act0, act)
    assert plan.predictions["compute_s"] < base.predictions["compute_s"]   # fixed costs (optimizer, launches) stay
    # attention FLOPs: the graph captured at seq/cp, its score GEMMs scaled by cp, equal 1/cp of the whole
    whole = model_structure(capture(model, None, batch=(1, seq), dtype=torch.bfloat16)).blocks[0].attention.work
    local = cp_structure(model_structure(capture(model, None, batch=(1, seq // cp), dtype=torch.bfloat16)),
                         cp).blocks[0].attention.work
    score = [sum(g[0] for g in w.core.gemms) for w in (whole, local)]
    assert score[1] == pytest.approx(score[0] / cp, rel=1e-9), score
    cp_sec = plan.parallel["cp"]
    assert cp_sec["variant"] == "ring" and cp_sec["exchange_s"] > 0 and 0 <= cp_sec["exposed_s"] < cp_sec["exchange_s"]
    kv = 1 * (4 // 2) * (seq // cp) * 128 * 2 * 2   # the local [k|v] shard: bf16, KV heads / tp
    ring = [r for r in plan.predictions["collectives"] if r["mesh_dim"] == "cp" and r["kind"] == "send_recv"]
    assert {(r["phase"], r["bytes"], r["count"]) for r in ring} == {("forward", kv, 2 * (cp - 1) * 2),
                                                                    ("backward", kv, 2 * (2 * cp - 1) * 2)}


def test_cp_plans_verify_fsdp_over_cp_and_replicated_dp_cp():
    """FSDP2 over cp alone (no dp dimension) and the flat gradient all-reduce over dp x cp
    (fsdp=False) dry-run exactly, the loss's all-reduce included."""
    for shape, names, opts in [((4,), ("cp",), {}), ((2, 2), ("dp", "cp"), dict(fsdp=False))]:
        plan = _plan("llama", shape, names, hardware="h100_sxm", **opts)
        res = verify(plan, e2e_workers.build("llama", device="meta"))
        assert res.passed, (names, res.error, res.mismatches().to_string())
        grads = res.collectives[res.collectives["phase"] == "backward"]
        dim = "cp" if names == ("cp",) else "dp_cp"
        assert set(grads[grads["kind"] != "send_recv"]["mesh_dim"]) <= {dim}
        assert (plan.fsdp["enabled"], dim) in {(True, "cp"), (False, "dp_cp")}


@pytest.mark.parametrize("hardware,shape,variant", [("h100_sxm", (8, 4, 2), "ring"), ("cpu", (4, 4, 4), "allgather")])
def test_cp_plans_verify_exactly_at_world_64(hardware, shape, variant):
    """Llama-3-8B's shape at world 64: the ring at 8K tokens on H100s (exchange hidden behind
    attention), the all-gather on the cpu profile over gloo at 64 tokens (latency-bound: fewer
    messages win; the suite's cpu profile is pinned in tests/conftest.py)."""
    model = repo_llama_8b(2)
    batch = (shape[0], 8192) if hardware != "cpu" else (shape[0], 64)
    plan = autoplan(model, MeshSpec(shape, ("dp", "cp", "tp"), hardware), batch=batch)
    assert math.prod(plan.mesh["shape"]) == 64 and plan.parallel["cp"]["degree"] == shape[1]
    assert plan.parallel["cp"]["variant"] == variant
    res = verify(plan, model)
    assert res.passed, (res.error, res.mismatches().to_string())
    kinds = set(res.collectives[res.collectives["mesh_dim"] == "cp"]["kind"])
    assert kinds == ({"send_recv"} if plan.parallel["cp"]["variant"] == "ring" else {"all_gather", "reduce_scatter"})


@pytest.mark.parametrize("world", [2, 4])
def test_cp_plans_apply_and_equal_one_device(world, request):
    # each layout once per model, the variants alternating (the runtime's tests run both on every layout);
    # gradients over cp (or dp x cp) by FSDP2 or, with fsdp=False, one flat all-reduce
    cases = {2: [("llama", (2,), ("cp",), "ring", {}), ("hf_llama", (2,), ("cp",), "allgather", dict(fsdp=False)),
                 ("hf_qwen3", (2,), ("cp",), "ring", {})],
             4: [("llama", (4,), ("cp",), "allgather", {}),
                 ("llama", (2, 2), ("dp", "cp"), "ring", {}),
                 ("hf_llama", (2, 2), ("dp", "cp"), "allgather", dict(fsdp=False)),
                 ("llama", (2, 2), ("cp", "tp"), "allgather", dict(allow_replicated_units=False,
                                                                  sequence_parallel=True)),
                 ("hf_llama", (2, 2), ("cp", "tp"), "ring", dict(allow_replicated_units=False,
                                                                sequence_parallel=False)),
                 ("hf_qwen3", (2, 2), ("cp", "tp"), "allgather", dict(allow_replicated_units=False))]}
    plans = []
    for name, shape, names, variant, opts in cases[world]:
        plan = _plan(name, shape, names, hardware="h100_sxm", **opts)
        if "tp" in names:
            assert plan.styles, f"{name} {names}: expected tensor-parallel styles"
        plans.append((f"{name}/{'x'.join(f'{n}{s}' for n, s in zip(names, shape))}", plan.to_json(), name, variant))
    results = request.getfixturevalue(f"pool{world}").run(cp_workers.run_cases, plans)
    for rank, per_rank in enumerate(results):
        for label, r in per_rank.items():
            where = f"{label} rank {rank}"
            assert abs(r["par"] - r["ref"]) <= 1e-5 * abs(r["ref"]), f"{where}: loss {r['par']} vs {r['ref']}"
            assert r["bad_grads"] == [], f"{where}: grads differ {r['bad_grads']}"
            assert r["bad_params"] == [], f"{where}: params after step differ {r['bad_params']}"
            assert r["n_grads"] > 0


def test_plan_context_chooses_the_split_by_cost():
    """dp x cp x tp for 4 devices at a long (for the model) sequence: every split planned, the
    fastest that fits wins, the rest listed; a memory limit below what tp alone needs picks cp > 1."""
    model = build_llama(device="meta", dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512,
                        ffn_hidden=512, max_seq_len=1024)
    assert context_meshes(4, (1, 1024), 8) == [(1, 4, 1), (1, 2, 2), (1, 1, 4)]
    best = plan_context(model, 4, batch=(1, 1024), activation_checkpointing=False)
    others = [a for a in best.alternatives if a["name"].startswith("cp ")]
    assert len(others) == 2 and all(best.predictions["step_s"] <= a["step_s"] for a in others)
    tp4 = autoplan(model, MeshSpec((4,), ("tp",)), batch=(1, 1024), activation_checkpointing=False)
    limit = 0.9 * tp4.predictions["memory_bytes"]["total"]
    tight = plan_context(model, 4, batch=(1, 1024), activation_checkpointing=False, memory_limit=limit)
    assert tight.parallel["cp"] and tight.parallel["cp"]["degree"] > 1
    assert tight.predictions["memory_bytes"]["total"] <= limit
    with pytest.raises(InvalidArgumentError, match="no dp x cp x tp split"):
        plan_context(model, 4, batch=(3, 4095))
