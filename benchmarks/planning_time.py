"""Planning time of the standard calls, in CPU seconds (robust to a shared host) and wall seconds:
autoplan on a fixed 70B mesh (dp64 x tp8), plan_cluster for the 70B and 405B shapes on 512 H100s.
One warm-up call first (imports, first export). Before each timed call the garbage collector runs
and freezes what survives (``gc.freeze``): a full collection of the process's millions of
objects costs 0.2-0.3 s and otherwise lands in whichever call crosses its threshold, which was the
largest single source of run-to-run spread here. Appends one row per call to
benchmarks/results/planning_time.csv under ``--label``; the markdown is rebuilt from the CSV.

    .venv/bin/python benchmarks/planning_time.py --label HEAD
    # the same calls on another tree (e.g. the commit an issue was filed at):
    PYTHONPATH=/path/to/that/tree .venv/bin/python benchmarks/planning_time.py --label c9923f5
"""
from __future__ import annotations

import gc
import os
import time
from pathlib import Path


from autoplan import MeshSpec, autoplan, plan_cluster
from autoplan.presets import build_preset
from labelled_runs import append_rows, start

OUT = Path(__file__).parent / "results" / "planning_time"
SEQ = 8192


def _timed(fn) -> tuple[float, float, object]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.process_time() - c, time.perf_counter() - w, out


def main() -> int:
    label = start(__doc__)
    plan_cluster(build_preset("llama3-70b", num_layers=2), 64, hardware="h100_sxm", batch=(64, SEQ))  # warm-up
    calls = [
        ("autoplan llama3-70b dp64 x tp8", lambda: autoplan(build_preset("llama3-70b"),
                                                            MeshSpec((64, 8), ("dp", "tp"), "h100_sxm"),
                                                            batch=(512, SEQ))),
        ("plan_cluster llama3-70b 512", lambda: plan_cluster(build_preset("llama3-70b"), 512, hardware="h100_sxm",
                                                             batch=(512, SEQ))),
        ("plan_cluster llama3-405b 512", lambda: plan_cluster(build_preset("llama3-405b"), 512, hardware="h100_sxm",
                                                              batch=(512, SEQ))),
    ]
    rows = []
    for name, fn in calls:
        gc.collect()
        gc.freeze()
        cpu, wall, plan = _timed(fn)
        rows.append({"label": label, "call": name, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
                     "mesh": "x".join(f"{n}{s}" for n, s in zip(plan.mesh["names"], plan.mesh["shape"])),
                     "load": round(os.getloadavg()[0], 1)})
        print(rows[-1], flush=True)
    df = append_rows(OUT.with_suffix(".csv"), rows)
    pivot = df.pivot_table(index="call", columns="label", values="cpu_s", aggfunc="min")
    OUT.with_suffix(".md").write_text(
        "# Planning time (CPU seconds, best of the runs recorded; wall and load in the CSV)\n\n"
        + pivot.to_markdown(floatfmt=".2f") + "\n\n" + df.to_markdown(index=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
