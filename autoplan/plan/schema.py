"""JSON schema of a plan file, and validation with messages a person can act on.

Two layers: ``plan_schema.json`` checks every field's type and range (integers are exact JSON
integers: ``2.0`` or ``true`` is not a count), then :func:`_check_consistency` checks what one
field cannot say alone -- mesh shape and names of one length and from the mesh-name vocabulary,
then every parallelism's section against the mesh and the other sections (each registry entry's
``check``: tp/dp dimensions that are the mesh's, a pipeline that matches it, HSDP degrees), and
styles that the style registry can rebuild. A plan that passes both loads to exactly the data
it was written from, and applying it fails only for reasons of the model or mesh it is given.
"""
from __future__ import annotations

import itertools
import json
from functools import lru_cache
from importlib import resources
from typing import Any

import jsonschema

from autoplan.errors import MeshNameError, PlanSchemaError
from autoplan.parallelisms import PARALLELISMS, parallel_schema
from hyper_parallel.parallel_dims import mesh_roles
from cost_models.hardware import list_hardware
from hyper_parallel.core.style_registry import STYLES, style_from_dict
from hyper_parallel.errors import HyperParallelError

# the plan-file format this autoplan writes and reads (see plan.py's docstring for what changed)
SCHEMA_VERSION = 3
# the older formats this autoplan upgrades on load
UPGRADABLE = (2,)

# exact JSON integers only: jsonschema's "integer" also accepts 2.0 (and Python's True is an int)
_TYPES = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda _checker, v: type(v) is int)
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_TYPES)


@lru_cache(maxsize=1)
def plan_schema() -> dict:
    """The plan file's JSON schema: plan_schema.json with the ``parallel`` field assembled from
    the registry's sections (each parallelism owns its fragment)."""
    schema = json.loads(resources.files("autoplan.plan").joinpath("plan_schema.json").read_text())
    schema["properties"]["parallel"] = parallel_schema()
    return schema


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
    degree = dict(zip(names, shape))
    for entry in PARALLELISMS:  # each parallelism checks its own section against the rest
        entry.check(data["parallel"].get(entry.name), data, roles, degree)
    # a mesh dimension, or several flattened in mesh order ("dp_cp": FSDP over dp x cp under context
    # parallel; "dp_ep": FSDP of the non-expert parameters over dp x ep, with pp between them in a pipeline)
    dims = {"_".join(c) for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)}
    for i, c in enumerate(data["predictions"]["collectives"]):
        if c["mesh_dim"] not in dims:
            raise PlanSchemaError(f"plan field predictions/collectives/{i}/mesh_dim: {c['mesh_dim']!r} is not a "
                                  f"mesh dimension {names} (or several flattened in mesh order, joined by '_')")


def upgrade_plan_data(data: Any) -> Any:
    """Schema-2 plan data in schema 3's form (a copy; anything else is returned as it is, for
    validation to judge): the fixed fields moved into their sections, values unchanged."""
    version = data.get("schema_version") if isinstance(data, dict) else None
    if type(version) is not int or version not in UPGRADABLE:
        return data
    old = dict(data)
    try:
        fsdp = dict(old.pop("fsdp"))
        rep = fsdp.pop("replicate_dim", None)
        r, s = fsdp.pop("replicate", None), fsdp.pop("shard", None)
        recompute, full = old.pop("recompute", None) or {}, old.pop("activation_checkpointing", False)
        ac = ({"mode": "selective", "modules": list(recompute.get("modules", []))}
              if recompute.get("mode") == "selective" else {"mode": "full" if full else "none"})
        old["parallel"] = {
            "tp": {"dim": old.pop("tp_dim"), "styles": old.pop("styles"), "stream_layout": old.pop("stream_layout"),
                   "loss_parallel": old.pop("loss_parallel")},
            "dp": {"dim": old.pop("dp_dim"), "fsdp": fsdp},
            "hsdp": {"dim": rep, "replicate": r, "shard": s} if rep else None,
            "ac": ac,
            "pp": old.pop("pipeline", None),
        }
        # parallelisms registered since (expert parallel): unused in a schema-2 file
        old["parallel"] = {**{p.name: p.default() for p in PARALLELISMS}, **old["parallel"]}
    except (KeyError, TypeError, AttributeError) as e:
        raise PlanSchemaError(f"schema-2 plan cannot be upgraded: field {e} missing or malformed") from None
    old["schema_version"] = SCHEMA_VERSION
    return old


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
    _check_styles(data["parallel"]["tp"]["styles"])
    _check_styles((data["parallel"].get("ep") or {}).get("styles", {}))
