"""What the planner predicts float8 buys, against torchtitan's published float8 rows, and how the best
layout moves when the Linears may train in float8.

Two sections, each priced by the cluster search with ``precision=`` (cost_models.precision: a float8
Linear's three GEMMs at the profile's datasheet float8 peak and the shape's efficiency, its six
casts at HBM bandwidth, tensorwise weights gathered by FSDP in one byte; nothing fitted to these runs):

- **torchtitan's float8 rows** (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables
  1, 3, 4 and 5; Grand Teton H100 HBM2e at 500 W, priced on ``h100_hbm2e_500w``): each row's layout
  fixed as published, compiled per block (torchtitan's ``apply_compile``), float8 on every Linear but
  the output (torchtitan's ``filter_fqns=["output"]``: ``fp8-tensorwise``, the recipe of that commit,
  with FSDP float8 all-gather), async TP where the row says so. Predicted step time beside the
  measured one (TPS/GPU converted to seconds per step). The 8B rows also sit beside their compiled
  bf16 row (the same tables), so the predicted float8 / bf16 ratio can be read against the measured.
  The 405B rows' micro-batch counts and cuts are not stated; torchtitan's defaults at that commit
  (9dec370: ``pipeline_parallel_microbatches`` None -> the pp degree, 8 micro-batches of 4; no split
  points -> ``generate_split_points``, layers spread evenly over the stages) are what is priced.
- **Where the layout moves**: the free search (``plan_cluster``) for Llama-3 8B and 70B on H100 and
  A100, in bf16 and with ``precision="auto"``: the chosen mesh, step time, and how many block Linears
  float8 took. On A100 (no float8 GEMM) nothing may change.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/float8_pricing.py [--no-write]

Writes benchmarks/results/float8_pricing.md.
"""
from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from pathlib import Path

import pandas as pd

from autoplan import plan_cluster
from autoplan.presets import build_preset
from autoplan.search.mesh.search import ClusterSearch
from hyper_parallel.core.pipeline_parallel import schedule_facts

sys.path.insert(0, str(Path(__file__).parent))
import published_runs as runs  # noqa: E402  (the dense benchmark's case loader and layout constraints)

log = logging.getLogger(__name__)
OUT = Path(__file__).parent / "results" / "float8_pricing.md"
SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
LLAMA_405B = {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "ffn": 53248, "vocab": 128256,
              "tied": False, "mlp": "swiglu", "norm": "rmsnorm", "params": 405853388800}


# Table 5: Llama 3.1 405B on 512 GPUs, FSDP 8 x TP 8 x PP 8, local batch 32 (8 micro-batches of 4)
TITAN_405B = [{"schedule": "1F1B", "tps": 100}, {"schedule": "Interleaved1F1B", "tps": 128}]


def titan_cases() -> list[dict]:
    """torchtitan's float8 rows as cases: (name, base case, layout changes, measured TPS/GPU,
    bf16 compiled TPS/GPU of the same table where it has one, async TP)."""
    _, cases = runs.load_cases()
    by_name = {c["name"]: c for c in cases}
    out = []
    for name, tps, bf16_tps, table in (("titan-8B-8", 8532, 6667, "Table 1"), ("titan-8B-128", 8380, 6514, "Table 3")):
        out.append({"row": f"8B, {by_name[name]['devices']} GPUs, FSDP ({table})", "case": by_name[name],
                    "measured_tps": tps, "bf16_compiled_tps": bf16_tps, "async_tp": False})
    base70 = by_name["titan-70B-256"]   # FSDP 32 x TP 8, local batch 16, full AC
    for tps, asy in ((829, False), (876, True)):
        out.append({"row": f"70B, 256 GPUs, FSDP 32 x TP 8{' + async TP' if asy else ''} (Table 4)", "case": base70,
                    "measured_tps": tps, "bf16_compiled_tps": None, "async_tp": asy})
    for row in TITAN_405B:
        schedule, tps, mbs = row["schedule"], row["tps"], 4
        v = schedule_facts(schedule).stages_per_rank(2)   # torchtitan's default: two stages a rank where it takes more
        case = copy.deepcopy(base70)
        case.update(name="titan-405B-512", devices=512, global_batch=256, model=dict(LLAMA_405B))
        case["layout"].update(dp=8, pp=8, tp=8, schedule=schedule, virtual_stages=v, microbatch_size=mbs,
                              recompute="full", sequence_parallel=True, cuts="even")
        out.append({"row": f"405B, 512 GPUs, FSDP 8 x TP 8 x PP 8, {schedule} + async TP (Table 5)", "case": case,
                    "measured_tps": tps, "bf16_compiled_tps": None, "async_tp": True})
    return out


def titan_rows() -> pd.DataFrame:
    rows = []
    models: dict[str, object] = {}
    for row in titan_cases():
        case = row["case"]
        key = case["model"]["layers"]
        if key not in models:
            models[key] = runs.build_model(case, check=False)
        cons, opts = runs.constraints(case)
        if case["layout"].get("cuts"):
            cons["cuts"] = case["layout"]["cuts"]
        batch, n = (case["global_batch"], case["seq_len"]), case["devices"]
        step, graphs = {}, None
        t0 = time.perf_counter()
        for precision in ("bf16", "fp8-tensorwise"):
            search = ClusterSearch.of(models[key], n, hardware=runs.priced_on(case), batch=batch, constraints=cons,
                                      memory_limit=1e30, compile="blocks", precision=precision, graphs=graphs,
                                      overlap="async_tp" if row["async_tp"] else "none", **opts)
            step[precision] = search.search()[0].step_s
            graphs = dict(search.graphs)
        measured = batch[0] * batch[1] / (row["measured_tps"] * n)
        bf16 = batch[0] * batch[1] / (row["bf16_compiled_tps"] * n) if row["bf16_compiled_tps"] else None
        rows.append({"row": row["row"], "measured_s": measured, "predicted_s": step["fp8-tensorwise"],
                     "predicted/measured": step["fp8-tensorwise"] / measured,
                     "measured_fp8/bf16": measured / bf16 if bf16 else None,
                     "predicted_fp8/bf16": step["fp8-tensorwise"] / step["bf16"],
                     "plan_s": time.perf_counter() - t0})
        log.info("%s: %s", row["row"], rows[-1])
    return pd.DataFrame(rows)


def layout_rows() -> pd.DataFrame:
    rows = []
    for preset, devices, batch in (("llama3-8b", 64, (256, 8192)), ("llama3-70b", 256, (512, 8192)),
                                   ("llama3-70b", 1024, (2048, 8192))):
        model = build_preset(preset)
        for hardware in ("h100_sxm", "a100_80gb"):
            for precision in ("bf16", "auto"):
                t0 = time.perf_counter()
                plan = plan_cluster(model, devices, batch=batch, hardware=hardware, compile="blocks",
                                    precision=precision)
                section = plan.parallel.get("precision") or {}
                mesh = " x ".join(f"{k}{v}" for k, v in zip(plan.mesh["names"], plan.mesh["shape"]) if v > 1)
                rows.append({"model": preset, "devices": devices, "hardware": hardware, "precision": precision,
                             "mesh": mesh or "1", "dp_mode": plan.fsdp.get("mode") or "replicate",
                             "recompute": (plan.parallel.get("ac") or {}).get("mode", "none"),
                             "microbatch": plan.pipeline.get("microbatch_size"),
                             "step_s": plan.predictions["step_s"],
                             "float8_patterns": len(section.get("modules", {})),
                             "plan_s": time.perf_counter() - t0})
                log.info("%s", rows[-1])
    return pd.DataFrame(rows)


def _async_lines(titan: pd.DataFrame) -> list[str]:
    """Async TP on / off in float8 (Table 4's two rows): the step ratio measured and predicted."""
    rows = titan[titan["row"].str.startswith("70B")]
    rows = rows.set_index(rows["row"].str.contains("async"))
    if len(rows) != 2:
        return []
    measured = rows.loc[True, "measured_s"] / rows.loc[False, "measured_s"]
    predicted = rows.loc[True, "predicted_s"] / rows.loc[False, "predicted_s"]
    return [f"Async TP on / off in float8 (70B, Table 4): measured step ratio {measured:.3f}, predicted "
            f"{predicted:.3f} ({abs(predicted - measured) * 100:.1f} points apart).", ""]


def write(titan: pd.DataFrame, layouts: pd.DataFrame) -> None:
    ratio = titan["predicted/measured"]
    lines = ["# Float8 pricing: torchtitan's float8 rows, and where the best layout moves", "",
             "Written by `benchmarks/float8_pricing.py` (see its docstring for every assumption). Regenerate: "
             "`PYTHONPATH=$PWD .venv/bin/python benchmarks/float8_pricing.py`.", "",
             f"## torchtitan's float8 rows ({SOURCE}, Tables 1, 3, 4, 5)", "",
             "Priced on h100_hbm2e_500w (the part they ran on), each row's published layout fixed, compiled per "
             "block, every Linear but the output in float8 tensorwise (FSDP float8 all-gather). "
             "`measured_fp8/bf16`: the float8 row's step over the same table's compiled bf16 row.", "",
             titan.to_markdown(index=False, floatfmt=".4g"), "",
             f"predicted / measured: {ratio.min():.3f} to {ratio.max():.3f}; within 15 %: "
             f"{int(((ratio - 1).abs() <= 0.15).sum())} of {len(ratio)}.", "",
             *_async_lines(titan),
             "## Where the best layout moves: bf16 vs `precision=\"auto\"` (free search, compiled per block)", "",
             layouts.to_markdown(index=False, floatfmt=".4g"), ""]
    OUT.write_text("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tables = [titan_rows(), layout_rows()]
    for table in tables:
        log.info("%s", table.to_string(index=False))
    if not args.no_write:
        write(*tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
