"""Random mutations of valid plan files, and the contract each mutant must meet.

Contract: a mutated plan file either raises PlanSchemaError when loaded, or loads to a
plan equal to the mutated data (nothing dropped or changed on the way in) that the review and
export functions, the style registry and the mesh description all accept -- never another
exception, never a plan that fails later for a reason the file could have been refused for.
Used by tests/inputs/test_plan_fuzz.py (a fixed-seed slice) and benchmarks/plan_fuzz.py (10,000).
"""
from __future__ import annotations

import copy
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from autoplan.errors import PlanSchemaError
from autoplan.plan.plan import Plan

VALUES: list[Any] = [None, True, False, 0, 1, -1, 2, 3, 1.5, 2.0, -0.5, 10**30, 2**63, "", "x", "false", "true",
                     "1", [], [1], ["dp"], {}, {"style": "ColwiseParallel", "args": {}}]
STRINGS = ["", "x", "dp", "tp", "pp", "data", "fsdp", "model", "y", "Shard(99)", "Shard(-9)", "Shard(0)", "Shard(1)",
           " Shard(1)", "Shard(1.0)", "Replicate()", "Partial(sum)", "Partial(prod)", "false", "ColwiseParallel",
           "NoSuchStyle", "1F1B", "Zigzag", "GPipe", "torch.int64", "torch.bfloat16", "h100_sxm", "h900", "layers.*",
           "layers..x", ".x", "R", "S", "all_reduce"]
TEXT_TOKENS = ["NaN", "Infinity", "-Infinity", "1e999", "null", "{", "]", "\"", ",", "0.1", "-0", "\\u0000"]


def _paths(node: Any, path: tuple = ()) -> list[tuple]:
    """Every path (tuple of keys / indices) into a JSON tree, the root included."""
    out = [path]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, path + (i,))
    return out


def _get(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


def _set(root: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _get(root, path[:-1])[path[-1]] = value
    return root


def mutate(data: dict, rng: random.Random) -> tuple[str, str]:
    """(operator name, mutated JSON text) of one random mutation of plan data ``data``."""
    d = copy.deepcopy(data)
    paths = _paths(d)
    op = rng.choice(["retype", "number", "string", "delete", "add_key", "list", "text", "swap"])
    if op == "text":
        text = json.dumps(d, indent=1, sort_keys=True)
        i = rng.randrange(len(text))
        how = rng.choice(["truncate", "drop", "insert", "number"])
        if how == "truncate":
            return "text-truncate", text[:i]
        if how == "drop":
            return "text-drop", text[:i] + text[i + 1:]
        if how == "insert":
            return "text-insert", text[:i] + rng.choice(TEXT_TOKENS) + text[i:]
        digits = [j for j, c in enumerate(text) if c.isdigit() and not text[j - 1].isdigit()]
        j = rng.choice(digits)
        k = j
        while k < len(text) and (text[k].isdigit() or text[k] in ".e-+"):
            k += 1
        return "text-number", text[:j] + rng.choice(TEXT_TOKENS[:4] + ["1e999", "0.1", "7"]) + text[k:]
    if op == "number":
        nums = [p for p in paths if isinstance(_get(d, p), (int, float)) and not isinstance(_get(d, p), bool)]
        p = rng.choice(nums)
        v = _get(d, p)
        new = rng.choice([v + 1, v - 1, -v, 0, v * 2**40, float(v), v + 0.5, int(v) if v == v else 0])
        return "number", json.dumps(_set(d, p, new))
    if op == "string":
        strs = [p for p in paths if isinstance(_get(d, p), str)]
        p = rng.choice(strs)
        return "string", json.dumps(_set(d, p, rng.choice(STRINGS)))
    if op == "delete":
        keys = [p for p in paths if p and isinstance(_get(d, p[:-1]), (dict, list))]
        p = rng.choice(keys)
        del _get(d, p[:-1])[p[-1]]
        return "delete", json.dumps(d)
    if op == "add_key":
        dicts = [p for p in paths if isinstance(_get(d, p), dict)]
        _get(d, rng.choice(dicts))[rng.choice(["extra", "x", "timing", "fsdp", ""])] = rng.choice(VALUES)
        return "add_key", json.dumps(d)
    if op == "list":
        lists = [p for p in paths if isinstance(_get(d, p), list) and _get(d, p)]
        lst = _get(d, rng.choice(lists))
        how = rng.choice(["pop", "dup", "reverse", "clear"])
        if how == "pop":
            lst.pop(rng.randrange(len(lst)))
        elif how == "dup":
            lst.append(copy.deepcopy(rng.choice(lst)))
        elif how == "reverse":
            lst.reverse()
        else:
            lst.clear()
        return f"list-{how}", json.dumps(d)
    if op == "swap":  # exchange two values of the same dict (e.g. tp_dim <-> dp_dim, shape entries)
        dicts = [p for p in paths if isinstance(_get(d, p), dict) and len(_get(d, p)) >= 2]
        node = _get(d, rng.choice(dicts))
        a, b = rng.sample(sorted(node, key=str), 2)
        node[a], node[b] = node[b], node[a]
        return "swap", json.dumps(d)
    p = rng.choice(paths)
    return "retype", json.dumps(_set(d, p, copy.deepcopy(rng.choice(VALUES))))


def _expected(data: dict) -> dict:
    """What a loaded plan must give back: the file's data, with the optional fields' defaults (every
    parallelism's section is required in schema 3, so only ``notes`` has one)."""
    out = dict(data)
    out.setdefault("notes", [])
    return out


def later_uses(plan: Plan, base: Plan) -> None:
    """What a user does with a loaded plan before applying it; none may fail."""
    from hyper_parallel.parallel_dims import ParallelDims

    repr(plan)
    plan.tp_plan()
    ParallelDims.from_dict(plan.mesh)
    plan.summary()
    plan.collectives()
    plan.module_table()
    plan.stage_table()
    plan.to_python()
    plan.diff(base)
    again = Plan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict(), "second round trip differs"


@dataclass
class FuzzResult:
    mutations: int = 0
    refused: int = 0
    loaded: int = 0
    escapes: list[str] = field(default_factory=list)
    by_op: Counter = field(default_factory=Counter)
    refused_by_op: Counter = field(default_factory=Counter)


def check(text: str, base: Plan) -> str | None:
    """None if ``text`` meets the contract ("refused" or loaded and usable), else the escape."""
    try:
        plan = Plan.from_json(text)
    except PlanSchemaError:
        return "refused"
    except Exception as e:  # noqa: BLE001 - this is what the fuzzer hunts
        return f"load raised {type(e).__name__}: {e}"
    try:
        data = json.loads(text)
    except ValueError as e:
        return f"loaded text that is not JSON: {e}"
    if plan.to_dict(timing="timing" in data) != _expected(data):
        return "loaded plan differs from the file"
    try:
        later_uses(plan, base)
    except Exception as e:  # noqa: BLE001
        return f"later use raised {type(e).__name__}: {e}"
    return None


def fuzz(plans: list[Plan], n: int, seed: int = 0) -> FuzzResult:
    """``n`` mutations (round robin over ``plans``) with a fixed seed."""
    rng = random.Random(seed)
    res = FuzzResult()
    datas = [p.to_dict() for p in plans]
    for i in range(n):
        base, data = plans[i % len(plans)], datas[i % len(plans)]
        op, text = mutate(data, rng)
        outcome = check(text, base)
        res.mutations += 1
        res.by_op[op] += 1
        if outcome == "refused":
            res.refused += 1
            res.refused_by_op[op] += 1
        elif outcome is None:
            res.loaded += 1
        else:
            res.escapes.append(f"#{i} {op}: {outcome}"[:400])
    return res


def base_plans() -> list[Plan]:
    """Valid plans to mutate: a dp x tp mesh plan with FSDP and SP styles, a pipelined cluster
    plan (pp=2) and the torchtitan styles priced on a tp=4 mesh (every Prepare* layout kind)."""
    from autoplan import MeshSpec, autoplan
    from tests.inputs.helpers import tiny_llama

    from autoplan.models.llama_plans import EXPERT_PLANS

    model = tiny_llama()
    titan = {k: v.to_dict() for k, v in EXPERT_PLANS["torchtitan"]().items()}
    return [
        autoplan(model, MeshSpec((2, 2), ("dp", "tp"), "h100_sxm"), batch=(4, 16), sequence_parallel=True),
        autoplan(model, 4, batch=(8, 16), constraints={"pp": 2, "dp": 1, "tp": 2}, microbatch_sizes=(2,)),
        autoplan(model, MeshSpec((4,), ("tp",), "h100_sxm"), batch=(2, 16), styles=titan),
    ]
