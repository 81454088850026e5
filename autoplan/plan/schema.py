"""JSON schema of a plan file, and validation with messages a person can act on."""
from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

from autoplan.errors import PlanSchemaError


@lru_cache(maxsize=1)
def plan_schema() -> dict:
    return json.loads(resources.files("autoplan.plan").joinpath("plan_schema.json").read_text())


def validate_plan_data(data: Any) -> None:
    """Raise PlanSchemaError for a wrong version, a missing/malformed field or an unknown style."""
    import jsonschema

    from autoplan.plan.plan import SCHEMA_VERSION
    from hyper_parallel.core.tensor_parallel.registry import STYLES, style_from_dict
    from hyper_parallel.errors import StyleSpecError

    if not isinstance(data, dict):
        raise PlanSchemaError(f"a plan must be a JSON object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PlanSchemaError(f"plan schema_version {version!r} is not supported (this autoplan reads {SCHEMA_VERSION})")
    try:
        jsonschema.validate(data, plan_schema())
    except jsonschema.ValidationError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "<root>"
        raise PlanSchemaError(f"plan field {where}: {e.message}") from None
    for pattern, spec in data["styles"].items():
        if spec.get("style") not in STYLES:
            raise PlanSchemaError(f"plan style for {pattern!r}: unknown style {spec.get('style')!r}; "
                                  f"known: {sorted(STYLES)}")
        try:
            style_from_dict(spec)
        except StyleSpecError as e:
            raise PlanSchemaError(f"plan style for {pattern!r}: {e}") from None
