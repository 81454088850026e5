"""Writes the notebooks in this folder from the cell sources below, executes them in a fresh
kernel and stores them with their outputs (tables and figures), so a reader sees the results on
a repository page or in a review without running anything.

Keeping the sources here makes them reviewable as plain Python; tests/review/test_notebooks.py
executes the .ipynb files in a fresh kernel and checks that every figure cell (tagged
``figure``) shows an image. Run: ``.venv/bin/python notebooks/make_notebooks.py`` (about two
minutes here; ``--no-execute`` writes the sources only).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
FIGURE_TAG = "figure"   # a cell that must display an image (asserted by the tests)


def figure_cell(source: str):
    """A code cell whose output is a figure."""
    return new_code_cell(source, metadata={"tags": [FIGURE_TAG]})

LLAMA70B = [
    new_markdown_cell("# Llama-3-70B on 64 H100: autoplan vs the torchtitan plan\n\n"
                      "Plan the Llama-3-70B shape (meta device, no weights) for a 8 x 8 (dp x tp) mesh of H100s, "
                      "import torchtitan's hand-written TP/SP plan, price both with the same cost model, and "
                      "compare. torchtitan's shipped 70B config: tp 8, local batch 8, seq 8192, full AC."),
    new_code_cell("import pandas as pd\n"
                  "import autoplan\n"
                  "from autoplan import MeshSpec, compare_plans\n"
                  "from autoplan.presets import build_preset\n"
                  "from autoplan.models.llama_plans import megatron_plan\n"
                  "from autoplan.review import save_figure\n"
                  "from autoplan.importers import import_torchtitan, import_plan\n"
                  "pd.set_option('display.width', 200)\n"
                  "mesh = MeshSpec((8, 8), ('dp', 'tp'), 'h100_sxm')\n"
                  "batch = (64, 8192)   # 8 sequences per dp rank\n"
                  "model = build_preset('titan-llama3-70b')   # the repo Llama at 70B shapes, torchtitan names"),
    new_code_cell("plan = autoplan.autoplan(model, mesh, batch=batch)\n"
                  "plan.model['plan_name'] = 'autoplan'\n"
                  "expert = import_torchtitan(model, mesh, batch=batch)   # expert_plans.json['torchtitan/llama3']\n"
                  "megatron = import_plan(model, mesh, megatron_plan(), name='megatron (no SP)', batch=batch)\n"
                  "plan, expert, megatron"),
    new_code_cell("table = compare_plans([plan, expert, megatron])\n"
                  "table[['mesh', 'stream', 'act_ckpt', 'step_s', 'vs_best', 'comm_s', 'tokens_per_s_per_device', "
                  "'mem_total_gib']]"),
    new_markdown_cell("## What differs from the expert plan?"),
    new_code_cell("d = plan.diff(expert)\n"
                  "print('identical to torchtitan' if d.empty else d.to_string())\n"
                  "plan.diff(megatron).head(12)"),
    new_markdown_cell("## Why this style? Each alternative's predicted cost"),
    new_code_cell("print(plan.explain('layers.0.attention.wo'))\nprint(plan.explain('output'))"),
    new_code_cell("plan.summary()[['unit', 'count', 'strategy', 'stream', 'compute_s', 'comm_s', 'memory_bytes']]"),
    new_markdown_cell("## Memory and communication"),
    figure_cell("fig = autoplan.review.plot_memory([plan, megatron], ['autoplan', 'megatron'], "
                "limit_bytes=80 * 2**30)\nfig"),
    figure_cell("plan.plot_communication()"),
    new_markdown_cell("## The whole cluster: dp x pp x tp, pipeline schedules, micro-batches\n\n"
                      "`plan_cluster` searches every factorization of the 64 devices (and the pipeline cuts, "
                      "schedule and micro-batching when pp > 1). Below: its best plan beside the expert's, then "
                      "a pipeline plan (pp 4 forced) with its per-stage table and simulated timeline."),
    new_code_cell("from autoplan.cluster import plan_cluster\n"
                  "best = plan_cluster(model, 64, batch=batch)\nbest.model['plan_name'] = 'plan_cluster'\n"
                  "piped = plan_cluster(model, 64, batch=batch, constraints={'pp': 4, 'tp': 8})\n"
                  "piped.model['plan_name'] = 'plan_cluster pp4'\n"
                  "compare_plans([best, piped, expert])[['mesh', 'pp', 'schedule', 'act_ckpt', 'step_s', 'vs_best', "
                  "'mem_total_gib']]"),
    new_code_cell("piped.stage_table()"),
    figure_cell("piped.plot_timeline()"),
    figure_cell("piped.plot_memory(limit_bytes=80 * 2**30)"),
    new_markdown_cell("## Hand it to torch or HF"),
    new_code_cell("hf = plan.to_hf_tp_plan(model)\n"
                  "print('HF can express:', hf.tp_plan)\nprint('HF cannot:', hf.not_expressible)\n"
                  "print(plan.to_python())"),
]

SWEEP = [
    new_markdown_cell("# Sweep device counts and hardware\n\n"
                      "Predicted training throughput of the Llama-3-70B shape at tp 8 with 8 sequences of 8192 "
                      "tokens per data-parallel rank, on 16 to 128 devices of four accelerators. Each point is a "
                      "full autoplan run (about half a second on a laptop CPU)."),
    new_code_cell("import pandas as pd\n"
                  "import autoplan\n"
                  "from autoplan import MeshSpec, compare_plans\n"
                  "from autoplan.errors import AutoplanError\n"
                  "from autoplan.presets import build_preset\n"
                  "model = build_preset('titan-llama3-70b')\n"
                  "HARDWARE = ['h100_sxm', 'a100_80gb', 'b200', 'ascend_910b']\n"
                  "DEVICES = [16, 32, 64, 128]\nTP, SEQ, LOCAL = 8, 8192, 8"),
    new_code_cell("plans, names = [], []\n"
                  "for hw in HARDWARE:\n"
                  "    for n in DEVICES:\n"
                  "        dp = n // TP\n"
                  "        try:\n"
                  "            plans.append(autoplan.autoplan(model, MeshSpec((dp, TP), ('dp', 'tp'), hw), "
                  "batch=(LOCAL * dp, SEQ)))\n"
                  "            names.append(f'{hw}/{n}')\n"
                  "        except AutoplanError as e:\n"
                  "            print(f'{hw} x {n}: {e}')\n"
                  "table = compare_plans(plans, names)\n"
                  "table[['hardware', 'devices', 'step_s', 'tokens_per_s', 'tokens_per_s_per_device', 'comm_fraction', "
                  "'mem_total_gib', 'act_ckpt']]"),
    figure_cell("from autoplan.review import new_figure   # a matplotlib Figure that shows itself in notebooks\n"
                "fig = new_figure(figsize=(7, 4)); ax = fig.add_subplot()\n"
                "for hw, rows in table.groupby('hardware'):\n"
                "    ax.plot(rows['devices'], rows['tokens_per_s'] / 1e3, marker='o', label=hw)\n"
                "ax.set_xscale('log', base=2); ax.set_xlabel('devices'); ax.set_ylabel('predicted k tokens / s')\n"
                "ax.set_title('Llama-3-70B shape, tp 8, 8 x 8192 tokens per dp rank'); ax.legend()\nfig"),
    new_code_cell("# scaling efficiency: throughput per device relative to the smallest mesh\n"
                  "eff = table.groupby('hardware')['tokens_per_s_per_device'].transform(lambda s: s / s.iloc[0])\n"
                  "table.assign(efficiency=eff)[['hardware', 'devices', 'efficiency']]"
                  ".pivot(index='devices', columns='hardware')"),
]

APPLY = [
    new_markdown_cell("# Apply and verify a small plan on this CPU\n\n"
                      "1. plan a small Llama for a 2-rank tensor-parallel mesh priced with this host's CPU profile;\n"
                      "2. dry run: parallelize on a fake process group and check that the collectives the runtime "
                      "issues equal the predicted ones (and the same at 64 ranks, dp 16 x tp 4);\n"
                      "3. train it on 2 gloo ranks beside a one-device copy and compare the losses."),
    new_code_cell("import torch\n"
                  "from autoplan import MeshSpec, autoplan\n"
                  "from autoplan.models import build_llama\n"
                  "from autoplan.demo import DEMO_MODEL, plan_demo_model, run_demo\n"
                  "from autoplan.verify import verify\n"
                  "plan = plan_demo_model(world=2, batch=4, seq=32)\n"
                  "plan"),
    new_code_cell("plan.summary()[['unit', 'strategy', 'stream', 'compute_s', 'comm_s', 'reason']]"),
    new_code_cell("result = verify(plan, build_llama(device='meta', **DEMO_MODEL))\n"
                  "assert result.passed\nresult.collectives"),
    new_code_cell("big = autoplan(build_llama(device='meta', **DEMO_MODEL), "
                  "MeshSpec((16, 4), ('dp', 'tp'), 'h100_sxm'),"
                  " batch=(64, 64), allow_replicated_units=False)\n"
                  "big_result = verify(big, build_llama(device='meta', **DEMO_MODEL))\n"
                  "assert big_result.passed\nbig_result.collectives"),
    new_code_cell("demo = run_demo(world=2, plan_name='auto', steps=3)\n"
                  "assert demo.max_rel_diff <= 1e-5, demo.steps\n"
                  "demo.steps"),
    new_code_cell("print(f'max relative loss difference {demo.max_rel_diff:.2e}; step time predicted '\n"
                  "      f'{demo.predicted_step_s * 1e3:.1f} ms, measured {demo.measured_step_s * 1e3:.1f} ms')"),
]

COMPARE = [
    new_markdown_cell("# Compare plans of one model side by side\n\n"
                      "Four plans for the Llama-3-8B shape (torchtitan's module names) on 64 H100s, 128 sequences "
                      "of 8192 tokens: autoplan's pick over every dp x pp x tp split, the best plans with a 2- and "
                      "a 4-stage pipeline, and torchtitan's hand-written TP/SP plan at tp 8 -- all priced by the "
                      "same cost model. The same comparison as one HTML page: "
                      "`autoplan report a.json b.json c.json -o plans.html`."),
    new_code_cell("import autoplan\n"
                  "from autoplan import MeshSpec, compare_plans\n"
                  "from autoplan.cluster import plan_cluster\n"
                  "from autoplan.presets import build_preset\n"
                  "from autoplan.review import plot_memory, plot_timeline\n"
                  "from autoplan.importers import import_torchtitan\n"
                  "model = build_preset('titan-llama3-8b')   # on meta: shapes only\n"
                  "batch = (128, 8192)"),
    new_code_cell("plans = {\n"
                  "    'autoplan': plan_cluster(model, 64, batch=batch),\n"
                  "    'pp 2': plan_cluster(model, 64, batch=batch, constraints={'pp': 2}),\n"
                  "    'pp 4 x tp 2': plan_cluster(model, 64, batch=batch, constraints={'pp': 4, 'tp': 2}),\n"
                  "    'torchtitan tp 8': import_torchtitan(model, MeshSpec((8, 8), ('dp', 'tp'), 'h100_sxm'), "
                  "batch=batch),\n"
                  "}\n"
                  "table = compare_plans(plans)\n"
                  "table[['mesh', 'pp', 'schedule', 'fsdp', 'act_ckpt', 'step_s', 'vs_best', 'comm_fraction', "
                  "'tokens_per_s_per_device', 'mem_total_gib']]"),
    new_markdown_cell("## Memory per rank\n\nPipelined plans show one bar per pipeline rank (the fullest "
                      "bounds the plan); the dashed line is an H100's 80 GB."),
    figure_cell("plot_memory(list(plans.values()), list(plans), limit_bytes=80 * 2**30)"),
    new_markdown_cell("## Timelines on one time axis\n\nOne simulated training step per plan, per pipeline "
                      "rank: forward (F), input-gradient (I/B) and weight-gradient (W) work of each micro-batch."),
    figure_cell("plot_timeline(list(plans.values()), names=list(plans))"),
    new_markdown_cell("## Where do two plans differ, and why?"),
    new_code_cell("plans['autoplan'].diff(plans['torchtitan tp 8']).head(10)"),
    new_code_cell("print(plans['pp 4 x tp 2'].explain('layers.0.attention.wq'))"),
    new_code_cell("plans['pp 4 x tp 2'].stage_table()"),
]

NOTEBOOKS = {"01_llama3_70b_vs_torchtitan.ipynb": LLAMA70B, "02_sweep_devices_hardware.ipynb": SWEEP,
             "03_apply_and_verify_on_cpu.ipynb": APPLY, "04_compare_plans.ipynb": COMPARE}


def build(name: str):
    """The notebook ``name`` from its cell sources (no outputs)."""
    cells = [nbformat.from_dict(c) for c in NOTEBOOKS[name]]
    for i, cell in enumerate(cells):
        cell.id = f"cell-{i:02d}"   # stable ids: regenerating changes only what the outputs change
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    nbformat.validate(nb)
    return nb


def execute(nb, timeout: int = 600):
    """Run ``nb`` top to bottom in a fresh python3 kernel started in this folder (this interpreter's
    bin folder first on PATH, so the kernel is this environment's Python)."""
    env_path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    os.environ["PATH"] = env_path
    NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to write (default: all)")
    parser.add_argument("--no-execute", action="store_true", help="write the sources without outputs")
    args = parser.parse_args(argv)
    for name in args.names or NOTEBOOKS:
        nb = build(name)
        if not args.no_execute:
            execute(nb)
        nbformat.write(nb, HERE / name)
        print(f"wrote {HERE / name} ({(HERE / name).stat().st_size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
