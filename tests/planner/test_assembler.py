"""A Plan is built in one place (autoplan/assembler.py) and is a value afterwards.

Two guards: at run time a built plan refuses any assignment to its fields (PlanSealedError) and
``replace`` makes a changed copy; in the code, no module but the assembler (and the Plan class itself)
writes a plan's fields -- an assignment, an item assignment into a section, or an in-place list
method on one -- so a new search hands the assembler its result instead of editing a plan.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from autoplan import MeshSpec, Plan, autoplan
from autoplan.assembler import fastest_of, with_notes
from autoplan.errors import PlanSealedError
from autoplan.plan.plan import is_sealed, plan_fields
from tests.inputs.helpers import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
WRITERS = {"autoplan/assembler.py", "autoplan/plan/plan.py"}
IN_PLACE = {"append", "extend", "insert", "update", "pop", "clear", "remove", "setdefault", "sort"}


def _plan_like(node: ast.AST) -> bool:
    """A receiver the code names as a plan (``plan``, ``tp_plan``, ``draft``, ...)."""
    return isinstance(node, ast.Name) and ("plan" in node.id.lower() or node.id == "draft")


def _field_of(node: ast.AST) -> str | None:
    """``plan.<field>`` (also under subscripts: ``plan.pipeline["x"][0]``) -> the field's name."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and _plan_like(node.value) and node.attr in plan_fields():
        return node.attr
    return None


def plan_writes(root: Path = ROOT, packages=("autoplan",), allowed=WRITERS) -> list[str]:
    """``path:line: text`` of every write to a plan's fields outside ``allowed``."""
    found = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in allowed:
                continue
            src = path.read_text()
            lines = src.splitlines()
            for node in ast.walk(ast.parse(src)):
                targets = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                    targets = [node.target]
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in IN_PLACE:
                    targets = [node.func.value]
                if any(_field_of(t) for t in targets):
                    found.append(f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def test_only_the_assembler_writes_a_plan():
    found = plan_writes()
    assert not found, ("a plan's fields are written outside autoplan/assembler.py (return the result and let the "
                       "assembler write it; plan.replace(...) makes a changed copy):\n" + "\n".join(found))


def test_the_guard_sees_writes(tmp_path):
    (tmp_path / "autoplan").mkdir()
    (tmp_path / "autoplan" / "a.py").write_text(
        "def f(plan, tp_plan, search):\n"
        "    plan.notes = []\n"                      # an assignment
        "    tp_plan.pipeline['x'] = 1\n"            # into a section
        "    plan.notes.append('n')\n"               # in place
        "    search.model = None\n"                  # not a plan: fine
        "    return plan.replace(notes=[])\n")       # a copy: fine
    assert [row.split(":")[1] for row in plan_writes(tmp_path, allowed=set())] == ["2", "3", "4"]


@pytest.fixture(scope="module")
def plan():
    return autoplan(tiny_llama(), MeshSpec((2, 2), ("dp", "tp"), "h100_sxm"), batch=(4, 16))


@pytest.mark.parametrize("field, value", [("notes", []), ("fsdp", {"enabled": False}), ("styles", {}),
                                          ("predictions", {}), ("pipeline", None)])
def test_a_built_plan_refuses_assignment(plan, field, value):
    before = plan.to_json()
    with pytest.raises(PlanSealedError, match=rf"Plan\.{field}: .*plan\.replace"):
        setattr(plan, field, value)
    assert plan.to_json() == before


def test_replace_and_loading_give_sealed_values(plan):
    changed = plan.replace(notes=["a note"])
    assert changed.notes == ["a note"] and plan.notes != ["a note"] and is_sealed(changed)
    loaded = Plan.from_json(plan.to_json())
    assert loaded.to_dict() == plan.to_dict() and is_sealed(loaded)


def test_assembler_functions_copy_a_sealed_plan(plan):
    noted = with_notes(plan, ["extra"])
    assert noted.notes[-1] == "extra" and "extra" not in plan.notes and is_sealed(noted)
    other = plan.replace(predictions=dict(plan.predictions, step_s=plan.predictions["step_s"] * 2))
    best = fastest_of([other, plan], "label")
    assert best.predictions["step_s"] == plan.predictions["step_s"] and len(best.alternatives) == \
        len(plan.alternatives) + 1 and is_sealed(best)


def test_a_sealed_plans_sections_are_read_only_all_the_way_down():
    """Sealing freezes the sections too: an in-place edit through any alias of a nested dict or
    list raises, and the plan still reads, serialises, pickles and copies as before."""
    import copy
    import pickle

    plan = autoplan(tiny_llama(), MeshSpec((2,), ("tp",), "cpu"), batch=(2, 16))
    section, rows = plan.parallel["tp"], plan.decisions
    for write in (lambda: plan.model.__setitem__("source", "x"), lambda: section["styles"].update({}),
                  lambda: rows.append({}), lambda: rows[0].__setitem__("chosen", "x"),
                  lambda: plan.predictions.setdefault("k", 1), lambda: plan.notes.extend(["n"])):
        with pytest.raises(PlanSealedError):
            write()
    again = Plan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json() == pickle.loads(pickle.dumps(plan)).to_json()
    with pytest.raises(PlanSealedError):   # a pickled plan (what a spawned rank receives) stays sealed
        pickle.loads(pickle.dumps(plan)).model.__setitem__("source", "x")
    named = plan.replace(model=dict(plan.model, source="mine"))   # the way to change one
    assert named.model["source"] == "mine" and "source" not in plan.model
    assert copy.deepcopy(plan).to_json() == plan.to_json()
