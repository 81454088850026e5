"""JSON schema of a plan file, and validation with messages a person can act on.

Two layers: ``plan_schema.json`` checks every field's type and range (integers are exact JSON
integers: ``2.0`` or ``true`` is not a count), then :func:`_check_consistency` checks what one
field cannot say alone -- mesh shape and names of one length and from the mesh-name vocabulary,
``tp_dim``/``dp_dim``/``fsdp.dim`` naming the right mesh dimensions, a pipeline that matches the
mesh, styles that the registry can rebuild. A plan that passes both loads to exactly the data
it was written from, and applying it fails only for reasons of the model or mesh it is given.
"""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

import jsonschema

from autoplan.errors import MeshNameError, PlanSchemaError
from hyper_parallel.parallel_dims import mesh_roles
from cost_models.hardware import list_hardware
from hyper_parallel.core.pipeline_parallel import schedule_facts
from hyper_parallel.core.tensor_parallel.registry import STYLES, style_from_dict
from hyper_parallel.errors import HyperParallelError

# the plan-file format this autoplan writes and reads (see plan.py's docstring for what changed)
SCHEMA_VERSION = 2

# exact JSON integers only: jsonschema's "integer" also accepts 2.0 (and Python's True is an int)
_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _checker, v: type(v) is int)
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_TYPES)


@lru_cache(maxsize=1)
def plan_schema() -> dict:
    return json.loads(resources.files("autoplan.plan").joinpath("plan_schema.json").read_text())


def _inline(node: Any, defs: dict) -> Any:
    """The schema with every local ``$ref`` replaced by its definition: the file stays readable,
    and validation skips reference lookups (they were most of the time to load a plan)."""
    if isinstance(node, dict):
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


@lru_cache(maxsize=1)
def _validator():
    schema = plan_schema()
    return _Validator(_inline(schema, schema.get("$defs", {})))


def _check_consistency(data: dict) -> None:
    mesh = data["mesh"]
    shape, names = mesh["shape"], mesh["names"]
    if len(shape) != len(names):
        raise PlanSchemaError(f"plan field mesh: shape {shape} and names {names} differ in length")
    if len(set(names)) != len(names):
        raise PlanSchemaError(f"plan field mesh/names: {names} repeats a dimension")
    try:
        roles = mesh_roles(names)
    except MeshNameError as e:
        raise PlanSchemaError(f"plan field mesh/names: {e}") from None
    hw = mesh["hardware"].strip().lower().replace("-", "_").replace(" ", "_")
    if hw not in list_hardware():
        raise PlanSchemaError(f"plan field mesh/hardware: {mesh['hardware']!r} is not a known profile; "
                              f"known: {list_hardware()}")
    for key, role in (("tp_dim", "tp"), ("dp_dim", "dp")):
        if data[key] is not None and data[key] != roles.get(role):
            raise PlanSchemaError(f"plan field {key}: {data[key]!r} is not the mesh's {role} dimension "
                                  f"(mesh names {names}; expected {roles.get(role)!r} or null)")
    if data["tp_dim"] is None and (data["styles"] or data["stream_layout"] == "S" or data["loss_parallel"]):
        raise PlanSchemaError("plan field tp_dim: null, but the plan has tensor-parallel styles, a sequence-parallel "
                              "stream or loss parallel; they would be silently skipped when applied")
    fsdp = data["fsdp"]
    if fsdp.get("dim") is not None and fsdp["dim"] != data["dp_dim"]:
        raise PlanSchemaError(f"plan field fsdp/dim: {fsdp['dim']!r} is not dp_dim {data['dp_dim']!r}")
    if fsdp["enabled"] and data["dp_dim"] is None:
        raise PlanSchemaError("plan field fsdp/enabled: true, but the plan has no dp_dim to shard over")
    degree = dict(zip(names, shape))
    pipe = data.get("pipeline")
    pp_name = roles.get("pp")
    pp_mesh = degree.get(pp_name, 1) if pp_name else 1
    if pipe is not None:
        pp = pipe["pp"]
        if pp != pp_mesh:
            raise PlanSchemaError(f"plan field pipeline/pp: {pp} but the mesh's pipeline dimension has "
                                  f"{pp_mesh} ranks (mesh {degree})")
        n = schedule_facts(pipe["schedule"], "plan field pipeline/schedule").n_stages(pp, pipe["virtual_stages"])
        if pp > 1 and len(pipe["cuts"]) != n - 1:
            raise PlanSchemaError(f"plan field pipeline/cuts: {pipe['schedule']} on pp={pp} has {n} stages, so "
                                  f"{n - 1} cuts, got {len(pipe['cuts'])}")
        if len(set(pipe["cuts"])) != len(pipe["cuts"]):
            raise PlanSchemaError(f"plan field pipeline/cuts: {pipe['cuts']} repeats a cut")
        s2r = pipe.get("stage_to_rank")
        if s2r is not None and (len(s2r) != n or any(r >= pp for r in s2r)):
            raise PlanSchemaError(f"plan field pipeline/stage_to_rank: {s2r} is not {n} ranks below pp={pp}")
        if pp > 1:
            for key in ("stages", "per_stage", "stage_to_rank"):
                if len(pipe.get(key) or []) != n:
                    raise PlanSchemaError(f"plan field pipeline/{key}: a {pipe['schedule']} plan on pp={pp} has "
                                          f"{n} stages; expected one entry per stage")
        gb = data["batch"].get("global_batch")
        dp = degree.get(roles.get("dp"), 1) if roles.get("dp") else 1
        if gb is not None and (gb % dp or (gb // dp) % pipe["microbatches"]):
            raise PlanSchemaError(f"plan field pipeline/microbatches: {pipe['microbatches']} does not divide the "
                                  f"per-dp-rank batch {gb}/{dp}")
    elif pp_mesh > 1:
        raise PlanSchemaError(f"plan field pipeline: null, but the mesh has {pp_name}={pp_mesh}")
    dims = set(names)
    for i, c in enumerate(data["predictions"]["collectives"]):
        if c["mesh_dim"] not in dims:
            raise PlanSchemaError(f"plan field predictions/collectives/{i}/mesh_dim: {c['mesh_dim']!r} is not a "
                                  f"mesh dimension {names}")
    for pattern in data["styles"]:
        if pattern and any(not atom for atom in pattern.split(".")):
            raise PlanSchemaError(f"plan styles: {pattern!r} is not a module pattern (empty name between dots)")


def _check_styles(styles: dict) -> None:
    for pattern, spec in styles.items():
        if spec.get("style") not in STYLES:
            raise PlanSchemaError(f"plan style for {pattern!r}: unknown style {spec.get('style')!r}; "
                                  f"known: {sorted(STYLES)}")
        try:
            style_from_dict(spec)
        except (HyperParallelError, TypeError, ValueError) as e:
            raise PlanSchemaError(f"plan style for {pattern!r}: {e}") from None


def validate_plan_data(data: Any) -> None:
    """Raise PlanSchemaError for a wrong version, a missing/malformed field, fields that
    contradict each other, or an unknown style."""
    if not isinstance(data, dict):
        raise PlanSchemaError(f"a plan must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        hint = " (schema 1 stored byte counts as rounded floats: plan again with this autoplan)" if version == 1 else ""
        raise PlanSchemaError(f"plan schema_version {version!r} is not supported (this autoplan reads "
                              f"{SCHEMA_VERSION}){hint}")
    error = jsonschema.exceptions.best_match(_validator().iter_errors(data))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "<root>"
        raise PlanSchemaError(f"plan field {where}: {error.message}")
    _check_consistency(data)
    _check_styles(data["styles"])
