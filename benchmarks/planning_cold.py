"""Planning time from a cold start: each call in a fresh interpreter, as a user pays it (one
``autoplan plan ...`` on the command line, one call in a fresh notebook kernel or on rank 0 of a job).

Per call and run, a fresh ``python`` process imports autoplan and builds the model on meta (both
timed apart: ``import_s``, ``build_s``), collects and freezes the garbage (``gc.freeze``: a full
collection of the process's objects otherwise lands in whichever call crosses the threshold), then
times the call (``cold_s`` wall, ``cold_cpu_s``), and the same call again in the same process
(``warm_s``: what planning_time.py measures). Each process starts with an empty planner disk cache
(``AUTOPLAN_CACHE_DIR`` set to a fresh directory holding only the hardware profiles), so ``cold_s`` is
the user's first ever call; ``--disk-cache`` instead keeps one cache for all runs of a call and
reports the first run apart (``first_s``) from the median of the rest.

The median of ``--runs`` processes (5) goes to benchmarks/results/planning_cold.csv under ``--label``
with the load average; the markdown is rebuilt from the CSV. Every run writes its plan's JSON; the
check compares them byte for byte with benchmarks/results/planning_cold_plans/ (plans saved from the
tree before the speed work: e2fe67b for the first round; regenerated from 06e039c, where later
features had changed the plans (``reduce_grads`` in the styles, DeepSeek-V3's cuts), before the
second; from f1b726f, where the cost model's pricing of casts and views and the MoE search's ep x pp
alternatives had changed them; vl-64 alone from 2d5f9f4, where a one-stage VL plan's parameter bytes
came to count the vision tower -- verify's dry run issues exactly the new figure, 507,088,784 bytes a
rank, where the old plan said 475,967,968) and a difference fails the run.

    .venv/bin/python benchmarks/planning_cold.py --label HEAD [--runs 5] [--only 70b-mesh,405b-128k]
    .venv/bin/python benchmarks/planning_cold.py --label 06e039c --save-plans   # write the reference plans
    .venv/bin/python benchmarks/planning_cold.py --profile 405b-128k           # cProfile of one cold call
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OUT = Path(__file__).parent / "results" / "planning_cold"
PLANS = Path(__file__).parent / "results" / "planning_cold_plans"

# name -> (what it is, the code that builds ``model`` and ``call`` in the child)
CALLS = {
    "70b-mesh": ("autoplan(llama3-70b, MeshSpec((64, 8), ('dp', 'tp')), batch=(512, 8192))",
                 "model = build_preset('llama3-70b')\n"
                 "call = lambda: autoplan(model, MeshSpec((64, 8), ('dp', 'tp'), 'h100_sxm'), batch=(512, 8192))"),
    "70b-512": ("plan_cluster(llama3-70b, 512, batch=(512, 8192))",
                "model = build_preset('llama3-70b')\n"
                "call = lambda: plan_cluster(model, 512, hardware='h100_sxm', batch=(512, 8192))"),
    "405b-512": ("plan_cluster(llama3-405b, 512, batch=(512, 8192))",
                 "model = build_preset('llama3-405b')\n"
                 "call = lambda: plan_cluster(model, 512, hardware='h100_sxm', batch=(512, 8192))"),
    "405b-128k": ("plan_cluster(llama3-405b at 128K positions, 16384, batch=(2048, 131072)) (cp searched)",
                  "model = build_preset('llama3-405b', max_position_embeddings=131072)\n"
                  "call = lambda: plan_cluster(model, 16384, hardware='h100_sxm', batch=(2048, 131072))"),
    "deepseek-v3": ("plan_cluster(deepseek-v3, 2048, hardware='h800', batch=(15360, 4096))",
                    "model = build_preset('deepseek-v3')\n"
                    "call = lambda: plan_cluster(model, 2048, hardware='h800', batch=(15360, 4096))"),
    "vl-64": ("plan_cluster(VL model: 7B-shaped decoder + 32-block ViT tower, 64, batch=(256, 4096))",
              "from autoplan.models.vision_language import VisionConfig, VisionLanguageModel\n"
              "from autoplan.models.llama import LlamaConfig\n"
              "with torch.device('meta'):\n"
              "    model = VisionLanguageModel(LlamaConfig(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,\n"
              "        vocab_size=152064, ffn_hidden=18944, max_seq_len=4096), VisionConfig(patch_dim=1176, width=1280,\n"
              "        n_layers=32, n_heads=16, mlp_hidden=3420), n_patches=256)\n"
              "call = lambda: plan_cluster(model, 64, hardware='h100_sxm', batch=(256, 4096))"),
}

CHILD = """
import gc, json, os, sys, time
t0 = time.perf_counter()
import logging
import torch
from autoplan import MeshSpec, autoplan, plan_cluster
from autoplan.presets import build_preset
logging.basicConfig(level=logging.ERROR)
torch.set_num_threads(1)
t1 = time.perf_counter()
{build}
t2 = time.perf_counter()
gc.collect(); gc.freeze()
w, c = time.perf_counter(), time.process_time()
plan = call()
cold, cold_cpu = time.perf_counter() - w, time.process_time() - c
js = plan.to_json()
warm = warm_cpu = float('nan')
if {warm}:
    gc.collect(); gc.freeze()
    w, c = time.perf_counter(), time.process_time()
    again = call()
    warm, warm_cpu = time.perf_counter() - w, time.process_time() - c
    assert again.to_json() == js, "a second call in the same process planned differently"
if {plan_out!r}:
    open({plan_out!r}, "w").write(js)
mesh = "x".join(f"{{n}}{{s}}" for n, s in zip(plan.mesh["names"], plan.mesh["shape"]))
print("RESULT " + json.dumps(dict(import_s=t1 - t0, build_s=t2 - t1, cold_s=cold, cold_cpu_s=cold_cpu,
                                  warm_s=warm, warm_cpu_s=warm_cpu, mesh=mesh)))
"""


def _hardware_cache() -> Path:
    """A fresh cache directory holding only the user's measured hardware profiles (the planner's
    other disk caches start empty: the first ever call)."""
    from cost_models.hardware.host import cache_dir

    root = Path(tempfile.mkdtemp(prefix="autoplan-cold-"))
    if (cache_dir() / "hardware").is_dir():
        shutil.copytree(cache_dir() / "hardware", root / "hardware")
    return root


def run_child(name: str, cache: Path, warm: bool = True, plan_out: str = "") -> dict:
    code = CHILD.format(build=CALLS[name][1], warm=warm, plan_out=plan_out)
    env = dict(os.environ, AUTOPLAN_CACHE_DIR=str(cache))
    env.pop("AUTOPLAN_TESTS_CACHE_PINNED", None)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{name}: child failed\n{res.stderr[-4000:]}")
    line = next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def measure(name: str, runs: int, disk_cache: bool, plans_dir: Path) -> dict:
    """Median of ``runs`` fresh processes; every run's plan compared with the reference."""
    shared = _hardware_cache() if disk_cache else None
    rows = []
    for i in range(runs):
        cache = shared or _hardware_cache()
        out = plans_dir / f"{name}.{i}.json"
        rows.append(run_child(name, cache, plan_out=str(out)))
        if shared is None:
            shutil.rmtree(cache, ignore_errors=True)
        print(f"  {name} run {i}: {rows[-1]}", flush=True)
    if shared is not None:
        shutil.rmtree(shared, ignore_errors=True)
    timed = rows[1:] if disk_cache and runs > 1 else rows
    med = {k: round(statistics.median(r[k] for r in timed), 2)
           for k in ("import_s", "build_s", "cold_s", "cold_cpu_s", "warm_s", "warm_cpu_s")}
    med["first_s"] = round(rows[0]["cold_s"], 2)
    med["first_cpu_s"] = round(rows[0]["cold_cpu_s"], 2)
    med["mesh"] = rows[0]["mesh"]
    return med


# predictions keys the planner has written since the reference plans were saved: how the step is
# priced as running (compiled, overlapped), "none" unless asked -- not a change of the plan itself
ADDED_SINCE_REFERENCE = ("compile", "overlap")


def _comparable(path: Path) -> dict:
    data = json.loads(path.read_text())
    for key in ADDED_SINCE_REFERENCE:
        data.get("predictions", {}).pop(key, None)
    return data


def compare_plans(names, plans_dir: Path) -> list[str]:
    """Names whose plan (any run) differs from the reference: every field, exactly, but the
    prediction keys added since the reference was saved (``ADDED_SINCE_REFERENCE``)."""
    bad = []
    for name in names:
        ref = PLANS / f"{name}.json"
        for got in sorted(plans_dir.glob(f"{name}.*.json")):
            if not ref.exists() or _comparable(got) != _comparable(ref):
                bad.append(f"{name} ({got.name})")
    return bad


def profile(name: str, sort: str) -> None:
    """cProfile of one cold call in this (fresh) process, imports and build excluded, with an empty
    planner cache (the first call ever)."""
    os.environ["AUTOPLAN_CACHE_DIR"] = str(_hardware_cache())
    scope: dict = {}
    exec("import torch\nfrom autoplan import MeshSpec, autoplan, plan_cluster\n"
         "from autoplan.presets import build_preset\n" + CALLS[name][1], scope)
    gc.collect()
    gc.freeze()
    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.runcall(scope["call"])
    print(f"{name}: {time.perf_counter() - t:.2f} s under cProfile")
    pstats.Stats(prof).sort_stats(sort).print_stats(45)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", default=",".join(CALLS))
    ap.add_argument("--disk-cache", action="store_true")
    ap.add_argument("--save-plans", action="store_true", help="write the reference plans (the tree before the work)")
    ap.add_argument("--profile", help="a call name: cProfile one cold call in this process")
    ap.add_argument("--sort", default="cumulative")
    args = ap.parse_args()
    if args.profile:
        profile(args.profile, args.sort)
        return 0
    if not args.label:
        ap.error("--label is required")
    import pandas as pd

    names = args.only.split(",")
    plans_dir = Path(tempfile.mkdtemp(prefix="autoplan-cold-plans-"))
    rows = []
    for name in names:
        load = os.getloadavg()[0]
        med = measure(name, args.runs, args.disk_cache, plans_dir)
        rows.append({"label": args.label, "call": name, "disk_cache": args.disk_cache, "runs": args.runs, **med,
                     "load": round((load + os.getloadavg()[0]) / 2, 1)})
        print(rows[-1], flush=True)
    if args.save_plans:
        PLANS.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy(plans_dir / f"{name}.0.json", PLANS / f"{name}.json")
    bad = compare_plans(names, plans_dir)
    for r in rows:
        r["plan_identical"] = not any(b.startswith(r["call"] + " ") for b in bad)
    csv = OUT.with_suffix(".csv")
    df = pd.concat([pd.read_csv(csv), pd.DataFrame(rows)]) if csv.exists() else pd.DataFrame(rows)
    df.to_csv(csv, index=False)
    calls = pd.DataFrame([{"call": k, "what": v[0]} for k, v in CALLS.items()])
    OUT.with_suffix(".md").write_text(
        "# Planning time from a cold start (fresh process per call; median of the runs; seconds)\n\n"
        "`cold_s`: the call in a fresh process (imports and model build before the clock: `import_s`, "
        "`build_s`); `warm_s`: the same call again in that process; `first_s` / `first_cpu_s`: the first run's call (with "
        "`disk_cache`: the first ever call, an empty cache; `cold_s` is then the median of the later runs); `load`: the 1-minute load average of this shared "
        "2-core host while measuring. Written by benchmarks/planning_cold.py.\n\n"
        + calls.to_markdown(index=False) + "\n\n" + df.to_markdown(index=False) + "\n")
    if bad:
        print("PLANS DIFFER from benchmarks/results/planning_cold_plans/: " + ", ".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
