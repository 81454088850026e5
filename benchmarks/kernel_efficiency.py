"""The kernels the published MoE runs are priced with, measured on a device beside the profile's price.

Every shape comes from the cost model itself (``autoplan.search.pricing.kernels``): each published MoE
run of ``moe_published_runs.py`` at its published layout -- its weight GEMMs at the rank's
tensor-parallel shard, its fused attention (head dim, causal or sliding window), its grouped expert
GEMMs at the rows an expert receives under its ep. The shapes several runs share are measured once.

Without ``--hardware`` it writes the list of shapes with the efficiency the run's datasheet profile
prices each at (``results/kernel_shapes.md``): what a device run will measure, reviewable before one is
lent. With it (on a GPU: ``--device cuda``) it times each kernel forward + backward
(``cost_models.kernel_efficiency.measure``) against ``--hardware`` and writes
``results/kernel_efficiency_<device>.{csv,md}`` and the profile with the measured points
(``results/kernel_efficiency_<device>.json``, for ``ClusterSearch.of(hardware=<that file>)``), then prices
the runs on that hardware again with it (``--reprice``):

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kernel_efficiency.py                       # the shapes
    PYTHONPATH=$PWD python benchmarks/kernel_efficiency.py --device cuda --hardware h100_sxm --reprice \
        --results $OUT     # on the lent device: what comes back is what it writes there

On an H200 measure against ``h100_sxm``: the same GH100 die (132 SMs, the same clocks and bf16 peak),
so its compute-bound kernels' efficiencies are the H100's (its faster HBM only shortens memory-bound
ones), and ``--reprice`` then prices the published H100 runs with them. The device image has torch,
transformers and pandas but not PuLP / HiGHS (the planner's solver): carry their wheels
(``pulp``, ``highspy``; the device README's recipe).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
import moe_published_runs as runs  # noqa: E402

from autoplan.search.mesh.search import ClusterSearch  # noqa: E402
from autoplan.search.pricing.kernels import priced_kernels  # noqa: E402
from cost_models.hardware import load_hardware  # noqa: E402
from cost_models.kernel_efficiency import KernelShape, measure, predicted_seconds, with_measured  # noqa: E402
from cost_models.profile_table import device_key  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def run_shapes(selected=None) -> tuple[list[KernelShape], dict]:
    """The distinct kernels of every published run (``selected``: names), with the runs and the
    hardware each shape was priced for."""
    seen: dict[tuple, KernelShape] = {}
    where: dict[tuple, list[str]] = {}
    for run in runs.RUNS:
        if selected and run.name not in selected:
            continue
        search = ClusterSearch.of(runs.build(run), run.devices, hardware=run.hardware, batch=(run.gbs, run.seq),
                               microbatch_sizes=(run.mbs,), memory_limit=1e30)
        for s in priced_kernels(search, b=run.mbs, tp=run.tp, ep=run.ep):
            key = (s.kind, s.m, s.n, s.k, s.groups, s.window)
            seen.setdefault(key, s)
            where.setdefault(key, []).append(f"{run.name} ({run.hardware})")
    shapes = [dataclasses.replace(s, note="; ".join(where[k])) for k, s in seen.items()]
    return shapes, where


def shapes_table(shapes: list[KernelShape]) -> pd.DataFrame:
    rows = []
    for s in shapes:
        hw_names = sorted({n.rsplit("(", 1)[1].rstrip(")") for n in s.note.split("; ")})
        row = {"kind": s.kind, "m": s.m, "n": s.n, "k": s.k, "groups": s.groups,
               "span": s.span if s.kind == "attention" else "", "gflop": s.flops() / 1e9}
        for name in hw_names:
            hw = load_hardware(name)
            row[f"{name}_eff"] = s.flops() / (predicted_seconds(hw, s) * hw.peak("bf16"))
        row["runs"] = s.note
        rows.append(row)
    df = pd.DataFrame(rows)
    return df[[c for c in df if c != "runs"] + ["runs"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hardware", default=None, help="the profile the device is measured against")
    ap.add_argument("--only", default=None, help="comma-separated run names")
    ap.add_argument("--reprice", action="store_true", help="price the runs on --hardware again with the measurements")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the folder written (a device run: its $OUT)")
    ap.add_argument("--max-gflop", type=float, default=None,
                    help="measure only kernels of at most this many GFLOP forward + backward (a quick check)")
    args = ap.parse_args(argv)
    results = args.results
    selected = set(args.only.split(",")) if args.only else None
    shapes, _ = run_shapes(selected)
    results.mkdir(parents=True, exist_ok=True)
    if not args.hardware:   # no profile to measure against: the list of what a device run measures
        table = shapes_table(shapes)
        (results / "kernel_shapes.md").write_text(
            "# The kernels the published MoE runs are priced with\n\n" + __doc__.split("\n\n")[1] + "\n\n"
            "Each shape with the efficiency its run's datasheet profile prices it at (forward + backward, on the "
            "work done: a causal or windowed attention's computed scores). A device run of "
            "`benchmarks/kernel_efficiency.py --device cuda --hardware NAME` measures these.\n\n"
            + table.to_markdown(index=False, floatfmt=".3g") + "\n")
        print(table.drop(columns="runs").to_string(index=False))
        return 0
    if args.max_gflop is not None:
        shapes = [s for s in shapes if s.flops() <= args.max_gflop * 1e9]
    import torch

    hw = load_hardware(args.hardware)
    t0 = time.perf_counter()
    frame = measure(shapes, hw, device=args.device, progress=lambda s: print(f"  {s.kind} {(s.m, s.n, s.k)}",
                                                                             flush=True))
    key = device_key(args.device)
    frame.to_csv(results / f"kernel_efficiency_{key}.csv", index=False, float_format="%.6g")
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else key
    measured = with_measured(hw, frame, f"benchmarks/kernel_efficiency.py on {name} (torch {torch.__version__}): "
                                        "forward + backward medians of the published MoE runs' kernels")
    (results / f"kernel_efficiency_{key}.json").write_text(json.dumps(measured.to_dict(), indent=2) + "\n")
    cols = ["kind", "m", "n", "k", "groups", "span", "measured_s", "predicted_s", "measured_eff", "predicted_eff",
            "measured_over_predicted", "error", "note"]
    lines = [f"# Kernel efficiency on {name} against the `{hw.name}` profile", "",
             f"{len(frame)} kernels in {time.perf_counter() - t0:.0f} s; profile with the measured points: "
             f"`kernel_efficiency_{key}.json`.", "", frame[cols].to_markdown(index=False, floatfmt=".4g"), ""]
    if args.reprice:
        path = results / f"kernel_efficiency_{key}.json"
        rows = []
        for run in runs.RUNS:
            if run.hardware != hw.name or (selected and run.name not in selected):
                continue
            before = runs.price(run, free=False)
            after = runs.price(dataclasses.replace(run, hardware=str(path)), free=False)
            rows.append({"case": run.name, "measured_s": run.measured_s, "ratio_datasheet": before.get("ratio"),
                         "ratio_measured_kernels": after.get("ratio")})
        lines += ["## The runs on this hardware priced again with the measured kernels", "",
                  pd.DataFrame(rows).to_markdown(index=False, floatfmt=".3f"), ""]
    (results / f"kernel_efficiency_{key}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0 if (frame["error"] == "").all() else 1


if __name__ == "__main__":
    sys.exit(main())
