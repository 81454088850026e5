"""Whole-search speed: plan_cluster (capture of every micro-batch shape + TP ILPs + mesh x pipeline
search + the final Plan) for the Llama-3-70B shape on 512 H100s and 405B on 1024... and the
planning time against the layer count (8, 16, 32, 80 layers of the 70B shape, 512 devices).
One run each after a warm-up (imports not counted). Writes benchmarks/results/cluster_scale.{csv,md}.

    .venv/bin/python benchmarks/cluster_scale.py
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pandas as pd

from autoplan import plan_cluster
from autoplan.presets import build_preset

OUT = Path(__file__).parent / "results" / "cluster_scale"
SEQ = 8192


def run(name: str, devices: int, gb: int, layers: int | None = None) -> dict:
    model = build_preset(name, num_layers=layers) if layers else build_preset(name)
    t0 = time.perf_counter()
    plan = plan_cluster(model, devices, hardware="h100_sxm", batch=(gb, SEQ))
    total = time.perf_counter() - t0
    m = plan.mesh["shape"]
    return {"model": name, "layers": layers or model.config.num_hidden_layers, "devices": devices,
            "global_batch": gb, "plan_s": total, "search_s": plan.timing.get("search_s"),
            "simulations": plan.solver.get("simulations"), "mesh": f"dp{m[0]}-pp{m[1]}-tp{m[2]}",
            "schedule": plan.pipeline["schedule"], "step_s": plan.predictions["step_s"]}


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    run("llama3-70b", 64, 64, layers=2)  # warm-up: imports, first export
    rows = [run("llama3-70b", 512, 512), run("llama3-405b", 512, 512)]
    for layers in (8, 16, 32, 80):
        r = run("llama3-70b", 512, 512, layers=layers)
        r["model"] = "llama3-70b (layers sweep)"
        rows.append(r)
    df = pd.DataFrame(rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT.with_suffix(".csv"), index=False, float_format="%.4g")
    sweep = df[df.model.str.contains("sweep")].set_index("layers").plan_s
    ratio = sweep.loc[80] / sweep.loc[8]
    load = os.getloadavg()[0]
    OUT.with_suffix(".md").write_text(
        "# plan_cluster speed (whole search, capture included)\n\n"
        f"Host: {os.cpu_count()} CPUs, load average {load:.1f} at the end (shared host).\n\n"
        + df.to_markdown(index=False, floatfmt=".3g")
        + f"\n\n80 layers / 8 layers planning time: {ratio:.2f}x (target <= 2x).\n")
    print(df.to_string())
    print(f"80/8 ratio {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
