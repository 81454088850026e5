"""Plan-file fuzzing: 10,000 random mutations (fixed seed) of three valid plans.

Every mutant must either raise PlanSchemaError on load, or load to exactly its data and survive
the later uses (styles rebuilt, mesh described, summary/module/stage tables, Python export, diff,
a second round trip). Anything else is an escape.

    PYTHONPATH=. python benchmarks/plan_fuzz.py [N] [SEED]   # writes benchmarks/results/plan_fuzz.md
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.inputs.plan_mutations import base_plans, fuzz  # noqa: E402


def main(n: int = 10_000, seed: int = 0) -> int:
    plans = base_plans()
    t0 = time.perf_counter()
    res = fuzz(plans, n, seed)
    dt = time.perf_counter() - t0
    lines = [
        "# Plan-file fuzzing", "",
        f"`PYTHONPATH=. python benchmarks/plan_fuzz.py {n} {seed}` — {n:,} mutations, seed {seed}, "
        f"{dt:.0f} s on this machine ({1e3 * dt / n:.1f} ms per mutation).", "",
        f"- refused with PlanSchemaError: {res.refused:,}",
        f"- loaded (equal to the mutated data, every later use ok): {res.loaded:,}",
        f"- **escapes: {len(res.escapes)}**", "",
        "| mutation | count | refused | loaded |", "|---|---:|---:|---:|",
    ]
    for op, c in sorted(res.by_op.items()):
        r = res.refused_by_op[op]
        lines.append(f"| {op} | {c} | {r} | {c - r - sum(1 for e in res.escapes if f' {op}:' in e)} |")
    if res.escapes:
        lines += ["", "## Escapes", ""] + [f"- {e}" for e in res.escapes[:50]]
    text = "\n".join(lines) + "\n"
    out = Path(__file__).parent / "results" / "plan_fuzz.md"
    out.write_text(text)
    print(text)
    return 1 if res.escapes else 0


if __name__ == "__main__":
    raise SystemExit(main(*(int(a) for a in sys.argv[1:3])))
