"""Plan files: exact integers (schema 2), a field-by-field round trip that verifies the same, and
the catalogue of bad files -- each refused with PlanSchemaError naming the field."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh

from autoplan import MeshSpec, Plan, autoplan
from autoplan.errors import PlanSchemaError
from autoplan.plan.plan import SCHEMA_VERSION
from hyper_parallel.local import fake_world
from tests.inputs.helpers import tiny_llama


@pytest.fixture(scope="module")
def plan():
    return autoplan(tiny_llama(), MeshSpec((2, 2), ("dp", "tp"), "h100_sxm"), batch=(4, 16), sequence_parallel=True)


@pytest.fixture(scope="module")
def cluster_plan():
    return autoplan(tiny_llama(), 4, batch=(8, 16), constraints={"pp": 2, "dp": 1, "tp": 2}, microbatch_sizes=(2,))


def _walk(node, path=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}/{i}")
    else:
        yield path, node


def test_counts_and_bytes_are_exact_integers(plan, cluster_plan):
    for p in (plan, cluster_plan):
        data = p.to_dict()
        assert data["schema_version"] == SCHEMA_VERSION == 3
        for path, v in _walk(data):
            if path == "/parallel/pp" and v is None:   # the pipeline section of a plan without one
                continue
            leaf = path.rsplit("/", 1)[-1]
            if "bytes" in path.split("/")[-2:][0] or leaf in ("bytes", "count", "memory_bytes", "num_parameters",
                                                             "microbatches", "pp", "global_batch", "seq_len"):
                assert type(v) is int, (path, v)
            if isinstance(v, float):  # floats are times and fractions only
                assert leaf.endswith("_s") or leaf in ("bubble_fraction",), (path, v)


@pytest.mark.parametrize("which", ["plan", "cluster_plan"])
def test_round_trip_field_by_field(which, request, tmp_path):
    p = request.getfixturevalue(which)
    path = tmp_path / "plan.json"
    p.to_json(path)
    q = Plan.from_json(path)
    for f in ("mesh", "tp_dim", "dp_dim", "styles", "stream_layout", "loss_parallel", "fsdp", "decisions",
              "predictions", "alternatives", "solver", "model", "batch", "notes", "activation_checkpointing",
              "pipeline", "schema_version"):
        assert json.dumps(getattr(q, f), sort_keys=True) == json.dumps(getattr(p, f), sort_keys=True), f
    assert q.to_dict() == p.to_dict()
    assert q.to_json() == p.to_json()


def test_exact_bytes_survive_the_file(plan):
    """Issue item 3: Mixtral's 2,861,912,064 parameter bytes came back as 2,861,912,060."""
    data = plan.to_dict()
    data["predictions"]["memory_bytes"]["params"] = 2_861_912_064
    data["predictions"]["collectives"][0]["bytes"] = 2**53 + 1  # beyond a double's exact range
    data["predictions"]["step_s"] = 0.1 + 0.2
    q = Plan.from_json(json.dumps(data))
    assert q.predictions["memory_bytes"]["params"] == 2_861_912_064
    assert q.predictions["collectives"][0]["bytes"] == 2**53 + 1
    assert q.predictions["step_s"] == 0.1 + 0.2


def test_read_back_plan_verifies_the_same(tmp_path):
    from autoplan.verify import verify

    model = tiny_llama()
    p = autoplan(model, MeshSpec((2, 2), ("dp", "tp"), "h100_sxm"), batch=(4, 16), allow_replicated_units=False)
    p.to_json(tmp_path / "p.json")
    q = Plan.from_json(tmp_path / "p.json")
    a, b = verify(p, tiny_llama()), verify(q, tiny_llama())
    assert a.passed and b.passed
    assert a.param_bytes == b.param_bytes
    assert a.collectives.equals(b.collectives)


_INTS = st.integers(min_value=0, max_value=2**70)
_TIMES = st.floats(min_value=0, max_value=1e12, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=_INTS, total=_INTS, coll=_INTS, step=_TIMES, comm=_TIMES, note=st.text(max_size=20),
       count=st.integers(min_value=1, max_value=2**40))
def test_round_trip_property(plan, params, total, coll, step, comm, note, count):
    """Any exact integer and any finite time survives the file unchanged (hypothesis)."""
    data = plan.to_dict()
    data["predictions"]["memory_bytes"].update(params=params, total=total)
    data["predictions"]["collectives"][0].update(bytes=coll, count=count)
    data["predictions"].update(step_s=step, comm_s=comm)
    data["notes"] = [note]
    p = Plan.from_dict(data)
    q = Plan.from_json(p.to_json())
    assert q.to_dict() == p.to_dict() == data


# ---------------------------------------------------------------- the catalogue of bad files
def _edit(data, fn):
    fn(data)
    return json.dumps(data)


def _style_key(data, style):
    return next(k for k, v in data["parallel"]["tp"]["styles"].items() if v["style"] == style)


CASES = [
    ("use_local_output string", lambda d: d["parallel"]["tp"]["styles"][_style_key(d, "PrepareModuleInput")]["args"].update(
        use_local_output="false"), "use_local_output: 'false' must be of type bool"),
    ("sequence_dim float", lambda d: d["parallel"]["tp"]["styles"][_style_key(d, "SequenceParallel")]["args"].update(sequence_dim=1.0),
     "sequence_dim: 1.0 must be of type int"),
    ("Shard(99)", lambda d: d["parallel"]["tp"]["styles"][_style_key(d, "PrepareModuleInput")]["args"].update(
        desired_input_layouts=["Shard(99)", None]),
     "Shard\\(99\\).*valid: Shard\\(d\\) with -8 <= d < 8"),
    ("mesh lengths", lambda d: d["mesh"].update(names=["dp"]), "shape \\[2, 2\\] and names \\['dp'\\] differ in length"),
    ("mesh names x,y", lambda d: d["mesh"].update(names=["x", "y"]), "does not say which parallelism"),
    ("tp_dim not in mesh", lambda d: d["parallel"]["tp"].update(dim="tensor"), "tp/dim: 'tensor' is not the mesh's tp dimension"),
    ("tp_dim == dp_dim", lambda d: d["parallel"]["tp"].update(dim="dp"), "tp/dim: 'dp'"),
    ("styles without tp_dim", lambda d: d["parallel"]["tp"].update(dim=None), "tp/dim: null, but the plan has tensor-parallel"),
    ("fsdp dim", lambda d: d["parallel"]["dp"]["fsdp"].update(dim="tp"), "fsdp/dim"),
    ("bytes as float", lambda d: d["predictions"]["memory_bytes"].update(params=2861912060.0),
     "memory_bytes/params: 2861912060.0 is not of type 'integer'"),
    ("count as bool", lambda d: d["predictions"]["collectives"][0].update(count=True), "count: True"),
    ("negative bytes", lambda d: d["predictions"]["collectives"][0].update(bytes=-1), "bytes: -1"),
    ("collective dim", lambda d: d["predictions"]["collectives"][0].update(mesh_dim="pp"), "mesh_dim: 'pp'"),
    ("unknown field", lambda d: d.update(stream="R"), "Additional properties are not allowed"),
    ("unknown style", lambda d: d["parallel"]["tp"]["styles"].update(x={"style": "eval", "args": {}}), "unknown style 'eval'"),
    ("schema 1", lambda d: d.update(schema_version=1), "schema_version 1 is not supported.*plan again"),
    ("hardware", lambda d: d["mesh"].update(hardware="h900"), "mesh/hardware: 'h900'"),
    ("batch zero", lambda d: d["batch"].update(global_batch=0), "global_batch"),
    ("dtype", lambda d: d["batch"].update(dtype="torch.int64"), "dtype"),
    ("bad pattern", lambda d: d["parallel"]["tp"]["styles"].update({"layers..wq": {"style": "NoParallel", "args": {}}}),
     "not a module pattern"),
    ("negative time", lambda d: d["predictions"].update(step_s=-1.0), "step_s"),
]


@pytest.mark.parametrize("name, fn, match", CASES, ids=[c[0] for c in CASES])
def test_bad_plan_files(plan, name, fn, match):
    with pytest.raises(PlanSchemaError, match=match):
        Plan.from_json(_edit(plan.to_dict(), fn))


PIPE_CASES = [
    ("pp vs mesh", lambda d: d["parallel"]["pp"].update(pp=4), "pp/pp: 4 but the mesh's pipeline dimension has 2"),
    ("cuts", lambda d: d["parallel"]["pp"].update(cuts=[]), "pp/cuts"),
    ("microbatches 0", lambda d: d["parallel"]["pp"].update(microbatches=0), "microbatches"),
    ("microbatches not dividing", lambda d: d["parallel"]["pp"].update(microbatches=3), "does not divide"),
    ("schedule", lambda d: d["parallel"]["pp"].update(schedule="Zigzag"), "pp/schedule"),
    ("no pipeline on a pp mesh", lambda d: d["parallel"].update(pp=None), "parallel/pp: null, but the mesh has pp=2"),
    ("per_stage missing", lambda d: d["parallel"]["pp"].update(per_stage=[]), "pp/per_stage"),
]


@pytest.mark.parametrize("name, fn, match", PIPE_CASES, ids=[c[0] for c in PIPE_CASES])
def test_bad_pipeline_fields(cluster_plan, name, fn, match):
    with pytest.raises(PlanSchemaError, match=match):
        Plan.from_json(_edit(cluster_plan.to_dict(), fn))


@pytest.mark.parametrize("text, match", [
    ('{"schema_version": 2, "x": NaN}', "NaN"), ('{"schema_version": 2, "x": 1e999}', "finite"),
    ("{" * 100000, "corrupted|nested"), ('{"schema_version": 2', "corrupted or truncated"),
    ("[1, 2]", "plan file"), ("no/such/file.json", "No such file"), ("a\0b", "plan file"),
])
def test_bad_json_text(text, match):
    with pytest.raises(PlanSchemaError, match=match):
        Plan.from_json(text)


def test_source_of_wrong_type():
    with pytest.raises(PlanSchemaError, match="expected a path or a JSON string"):
        Plan.from_json(42)


def test_apply_checks_its_arguments(plan):
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.errors import InvalidArgumentError
    from hyper_parallel.errors import MeshError
    from hyper_parallel.local import fake_world
    from tests.inputs.helpers import snapshot

    model = tiny_llama()
    before = snapshot(model)
    with pytest.raises(InvalidArgumentError, match="mesh must be a DeviceMesh named \\('dp', 'tp'\\) of shape \\(2, 2\\)"):
        plan.apply(model, {"shape": [2, 2]})
    with pytest.raises(InvalidArgumentError, match="model must be a torch.nn.Module"):
        plan.apply("llama", None)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        with pytest.raises(MeshError, match=r"shape \(2, 2\) named \('dp', 'tp'\), got shape \(4,\) named \('tp',\)"):
            plan.apply(model, mesh)
    assert snapshot(model) == before


def _as_schema_2(data: dict) -> dict:
    """The same plan in the schema-2 layout (fixed top-level fields), as files written before
    schema 3 have it."""
    old = {k: v for k, v in data.items() if k != "parallel"}
    par = data["parallel"]
    fsdp = dict(par["dp"]["fsdp"])
    if par["hsdp"]:
        fsdp.update(replicate_dim=par["hsdp"]["dim"], replicate=par["hsdp"]["replicate"], shard=par["hsdp"]["shard"])
    old.update(schema_version=2, tp_dim=par["tp"]["dim"], styles=par["tp"]["styles"],
               stream_layout=par["tp"]["stream_layout"], loss_parallel=par["tp"]["loss_parallel"],
               dp_dim=par["dp"]["dim"], fsdp=fsdp, activation_checkpointing=par["ac"]["mode"] == "full",
               pipeline=par["pp"])
    if par["ac"]["mode"] == "selective":
        old["recompute"] = dict(par["ac"])
    return old


@pytest.mark.parametrize("which", ["plan", "cluster_plan"])
def test_schema_2_files_load_unchanged(which, request):
    p = request.getfixturevalue(which)
    old = _as_schema_2(p.to_dict())
    q = Plan.from_json(json.dumps(old))
    assert q.to_dict() == p.to_dict()
    assert (q.styles, q.fsdp, q.pipeline, q.tp_dim, q.dp_dim) == (p.styles, p.fsdp, p.pipeline, p.tp_dim, p.dp_dim)


def test_schema_2_hsdp_and_selective_sections(plan):
    data = plan.to_dict()
    data["mesh"] = dict(data["mesh"], shape=[2] + data["mesh"]["shape"], names=["dp_replicate"] + data["mesh"]["names"])
    data["parallel"]["dp"]["fsdp"] = {"enabled": True, "dim": "dp"}
    data["parallel"]["hsdp"] = {"dim": "dp_replicate", "replicate": 2, "shard": 2}
    data["parallel"]["ac"] = {"mode": "selective", "modules": ["layers.*.attention"]}
    q = Plan.from_json(json.dumps(_as_schema_2(data)))
    assert q.parallel["hsdp"] == data["parallel"]["hsdp"] and q.parallel["ac"] == data["parallel"]["ac"]
    assert q.fsdp == {"enabled": True, "dim": "dp", "replicate_dim": "dp_replicate", "replicate": 2, "shard": 2}
    assert q.recompute_mode == "selective" and not q.activation_checkpointing
    bad = dict(data, parallel=dict(data["parallel"], hsdp={"dim": "dp_replicate", "replicate": 4, "shard": 2}))
    with pytest.raises(PlanSchemaError, match="parallel/hsdp: replicate=4 x shard=2"):
        Plan.from_json(json.dumps(bad))


def test_colwise_embedding_in_a_hand_written_plan_is_refused_before_it_runs():
    """A plan file edited by hand to put ColwiseParallel on the embedding would hand the residual stream
    a hidden-sharded tensor: applying it raises PlanSchemaError naming the entry and what is valid,
    instead of an untyped shape error inside the first forward."""
    data = autoplan(tiny_llama(), MeshSpec((2,), ("tp",), "h100_sxm"), batch=(2, 16)).to_dict()
    data["parallel"]["tp"]["styles"]["tok_embeddings"] = {"style": "ColwiseParallel", "args": {}}
    edited = Plan.from_dict(json.loads(json.dumps(data)))
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with pytest.raises(PlanSchemaError, match=r"styles\['tok_embeddings'\]: ColwiseParallel on the embedding"):
            edited.apply(tiny_llama(device="cpu"), mesh)
