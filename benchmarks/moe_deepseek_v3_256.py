"""A DeepSeek-V3-sized plan for 256 H100s, end to end through the public planner.

``plan_cluster`` on the DeepSeek-V3 shape (671B, 256 routed experts of 61 layers, the preset from
its published config) for 256 H100s (h100_sxm, 8 per node), 512 sequences of 4,096 tokens, with
NeMo AutoModel's published layout as constraints (dp 1 x ep 64 x pp 4, FSDP over dp x ep, full
recomputation, Interleaved1F1B with 8 stages per rank, even cuts) and priced for hyper_parallel's
own runtime (what ``plan.apply`` runs: all-to-alls of every routed copy, exposed) -- and, beside
it, the free search's own pick for the same devices and batch. For each: the constraints, the
mesh, memory per rank by term, the step time and its breakdown. Writes
benchmarks/results/moe_deepseek_v3_256.md (docs/moe.md shows it).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_deepseek_v3_256.py [--no-free]
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from autoplan import plan_cluster
from autoplan.errors import InfeasiblePlanError
from autoplan.presets import build_preset, use_fused_attention
from autoplan.review.compare import compare_plans

OUT = Path(__file__).parent / "results" / "moe_deepseek_v3_256.md"
DEVICES, BATCH, HARDWARE = 256, (512, 4096), "h100_sxm"
PUBLISHED = dict(dp=1, ep=64, pp=4, tp=1, microbatch_size=1, dp_mode="fsdp", recompute="full",
                 schedule="Interleaved1F1B", virtual_stages=8, cuts="even", expert_parallel=True)
G = 2.0 ** 30
log = logging.getLogger("moe_deepseek_v3_256")


def describe(label: str, plan, cons: dict | None, seconds: float) -> list[str]:
    """The plan as a reader checks it: what was asked, the layout, memory per rank, the step."""
    pred, pipe = plan.predictions, plan.pipeline or {}
    mem = pred["memory_bytes"]
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.mesh["names"], plan.mesh["shape"]))
    out = [f"### {label}", "",
           f"- constraints: `{cons}`" if cons else "- constraints: none (the free search)",
           f"- mesh: {mesh}; data parallel: {plan.fsdp.get('mode')}; recompute: "
           f"{(plan.recompute or {}).get('mode') or ('full' if plan.activation_checkpointing else 'none')}",
           f"- pipeline: {pipe.get('schedule')}, {pipe.get('virtual_stages')} stage(s) per rank, "
           f"{pipe.get('microbatches')} micro-batches of {pipe.get('microbatch_size')}, {pipe.get('cut_method')} cuts",
           f"- memory per rank (busiest pipeline rank): params {mem.get('params', 0) / G:.1f} GiB, grads "
           f"{mem.get('grads', 0) / G:.1f}, optimizer {mem.get('optimizer', 0) / G:.1f}, activations "
           f"{mem.get('activations', 0) / G:.1f} -> **{mem['total'] / G:.1f} GiB** of the device's usable 74.0",
           f"- step: **{pred['step_s']:.2f} s** = busy (compute + exposed TP / EP traffic) {pred['compute_s']:.2f} s "
           f"+ bubble {pred['bubble_s']:.2f} s + data-parallel and optimizer {pred['comm_s']:.2f} s",
           f"- planned in {seconds:.0f} s on this CPU", ""]
    out += [f"  - note: {n}" for n in plan.notes if "expert all-to-alls" in n or "MFU" in n]
    return out + [""]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-free", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = use_fused_attention(build_preset("deepseek-v3"))
    lines = ["# DeepSeek-V3 on 256 H100s, planned end to end", "", __doc__.split("\n\n")[1], "",
             "Regenerate with `PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_deepseek_v3_256.py`.", ""]
    t0 = time.perf_counter()
    plan = plan_cluster(model, DEVICES, batch=BATCH, hardware=HARDWARE, constraints=PUBLISHED)
    lines += describe("NeMo AutoModel's layout, hyper_parallel's runtime", plan, PUBLISHED, time.perf_counter() - t0)
    plans = {"published layout": plan}
    if not args.no_free:
        t1 = time.perf_counter()
        try:
            pick = plan_cluster(use_fused_attention(build_preset("deepseek-v3")), DEVICES, batch=BATCH,
                                hardware=HARDWARE, time_budget_s=120, max_simulations=80)
            lines += describe("The free search's pick", pick, None, time.perf_counter() - t1)
            plans["autoplan's pick"] = pick
        except InfeasiblePlanError as e:
            lines += ["### The free search's pick", "", f"none: {e}", ""]
    cols = ["mesh", "step_s", "vs_best", "compute_s", "comm_s", "mem_total_gib", "pp", "schedule"]
    frame = compare_plans(plans)
    lines += ["### Side by side (`autoplan.review.compare_plans`)", "",
              frame[[c for c in cols if c in frame]].to_markdown(floatfmt=".3g"), ""]
    OUT.write_text("\n".join(lines) + "\n")
    log.info("wrote %s", OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
