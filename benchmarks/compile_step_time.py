"""Step time of one 4-rank plan compiled (inductor) against the same plan in eager, on this CPU.

The plan: titan-llama-debug at dp=2 x tp=2 with FSDP, every unit sharded, planned for batch 8 x 32
tokens. Each setting is a separate ``autoplan train`` launch under torchrun (gloo) of ``--steps``
steps. The numbers are the median and the minimum ``step_s`` over the steps after the first two
(the first steps compile), plus the compile cost: what the first two steps took beyond two
steady steps.

    PYTHONPATH=. nice .venv/bin/python benchmarks/compile_step_time.py [--steps 30] [--dir WORK]

Writes benchmarks/results/compile_step_time.md. ``--from DIR`` rewrites it from the metrics CSVs
of an earlier run (``eager.csv``, ``blocks.csv``, ``model.csv`` in DIR) without training again.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from autoplan import plan_cluster
from autoplan.train.model import build_model

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "compile_step_time.md"
SETTINGS = {"eager": ["--compile", "none"],
            "blocks": ["--compile", "blocks", "--compile-backend", "inductor"],
            "model": ["--compile", "model", "--compile-backend", "inductor"]}


def make_plan(path: Path) -> None:
    meta = build_model("titan-llama-debug", device="meta")
    plan = plan_cluster(meta, 4, hardware="cpu", batch=(8, 32), devices_per_node=4,
                        constraints=dict(dp=2, tp=2, pp=1, fsdp=True), allow_replicated_units=False,
                        dtype=torch.float32)
    plan = plan.replace(model=dict(plan.model, source="titan-llama-debug"))
    plan.to_json(path)


def train(work: Path, name: str, steps: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
           "autoplan.cli", "train", "--plan", str(work / "plan.json"), "--steps", str(steps), "--lr", "2e-3",
           "--progress", "log", "--metrics", str(work / f"{name}.csv"), *SETTINGS[name]]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    subprocess.run(cmd, cwd=work, env=env, check=True, capture_output=True)


def summary(path: Path) -> dict:
    rows = list(csv.DictReader(open(path)))
    times = [float(r["step_s"]) for r in rows]
    steady = times[2:]
    median = statistics.median(steady)
    return {"steps": len(rows), "median_s": median, "min_s": min(steady), "compile_s": sum(times[:2]) - 2 * median,
            "graphs": rows[-1].get("graphs", "0"), "graph_breaks": rows[-1].get("graph_breaks", "0"),
            "last_loss": float(rows[-1]["loss"])}


def write(work: Path) -> str:
    found = {name: summary(work / f"{name}.csv") for name in SETTINGS if (work / f"{name}.csv").exists()}
    eager = found["eager"]
    lines = ["# Step time compiled vs eager: one 4-rank plan on this CPU", "",
             "Regenerate: `PYTHONPATH=. nice .venv/bin/python benchmarks/compile_step_time.py` (or `--from DIR` for "
             "the CSVs of an earlier run). titan-llama-debug, dp=2 x tp=2 FSDP, every unit sharded, batch 8 x 32, "
             "4 gloo ranks on this 2-core CPU, inductor. Steady step time = the median (and the minimum) of "
             "`step_s` after the first two steps; compile = what the first two steps took beyond two steady "
             "steps. The machine was shared with other jobs (load average above 20 on 2 cores), so single steps "
             "vary by 2-5x; the medians are the numbers to read, the ratio is within about +-30 %.", "",
             "| setting | steps | steady median s | steady min s | vs eager (median) | compile s | graphs | "
             "graph breaks | loss at last step |", "|:--|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for name, s in found.items():
        lines.append(f"| {name} | {s['steps']} | {s['median_s']:.3f} | {s['min_s']:.3f} | "
                     f"{s['median_s'] / eager['median_s']:.2f} | {s['compile_s']:.0f} | {s['graphs']} | "
                     f"{s['graph_breaks']} | {s['last_loss']:.6f} |")
    text = "\n".join(lines) + "\n"
    OUT.write_text(text)
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dir", default=None, help="work directory (default: a new one under /tmp)")
    ap.add_argument("--from", dest="source", default=None, help="rewrite the table from this directory's CSVs")
    args = ap.parse_args(argv)
    if args.source:
        print(write(Path(args.source)))
        return 0
    work = Path(args.dir or f"/tmp/compile-step-time-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    make_plan(work / "plan.json")
    for name in SETTINGS:
        train(work, name, args.steps)
    print(write(work))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
