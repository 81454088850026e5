"""autoplan -> Plan (JSON) -> apply on gloo ranks -> one training step equals one device."""
import pytest

from autoplan import MeshSpec, autoplan
from tests.planner import e2e_workers

# (model, mesh shape, names, planner options): sharded plans forced where the tiny models would
# otherwise (correctly) stay replicated, both residual-stream layouts, 1-D and dp x tp meshes
CASES = [
    ("llama", (2,), ("tp",), dict(allow_replicated_units=False, sequence_parallel=True)),
    ("llama_tied", (2,), ("tp",), dict(allow_replicated_units=False, sequence_parallel=False)),
    ("hf_llama", (2,), ("tp",), dict(allow_replicated_units=False, sequence_parallel=True)),
    ("hf_qwen2", (2,), ("tp",), dict(allow_replicated_units=False, sequence_parallel=False)),
    ("llama", (4,), ("tp",), dict(allow_replicated_units=False, sequence_parallel=True)),
    ("hf_llama_tied", (4,), ("tp",), dict(allow_replicated_units=False, sequence_parallel=True)),
    ("hf_mistral", (4,), ("tp",), dict(allow_replicated_units=False, sequence_parallel=False)),
    ("llama_kv2", (4,), ("tp",), dict(sequence_parallel=True)),
    ("llama", (2, 2), ("dp", "tp"), dict(allow_replicated_units=False, sequence_parallel=True)),
    ("hf_llama", (2, 2), ("dp", "tp"), dict(allow_replicated_units=False, sequence_parallel=False)),
    ("llama_tied", (2, 2), ("dp", "tp"), dict(allow_replicated_units=False, sequence_parallel=True, fsdp=False)),
]


def _plan(model_name, shape, names, opts):
    model = e2e_workers.build(model_name, device="meta")
    return autoplan(model, MeshSpec(shape, names, "h100_sxm"), batch=(4, 16), dtype=__import__("torch").float32,
                    **opts)


@pytest.mark.parametrize("world", [2, 4])
def test_autoplan_apply_step_equals_one_device(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    cases = [c for c in CASES if __import__("math").prod(c[1]) == world]
    for model_name, shape, names, opts in cases:
        plan = _plan(model_name, shape, names, opts)
        if opts.get("allow_replicated_units") is False:
            assert plan.styles, f"{model_name}: expected a sharded plan"
        results = pool.run(e2e_workers.run_case, plan.to_json(), model_name)
        for rank, r in enumerate(results):
            where = f"{model_name} mesh {dict(zip(names, shape))} rank {rank} stream {plan.stream_layout}"
            assert abs(r["par"] - r["ref"]) <= 1e-5 * abs(r["ref"]), f"{where}: loss {r['par']} vs {r['ref']}"
            assert r["bad_grads"] == [], f"{where}: grads differ {r['bad_grads']}"
            assert r["bad_params"] == [], f"{where}: params after step differ {r['bad_params']}"
            assert r["n_grads"] > 0
