"""Predicted vs measured step time of distinct plans of one model on 4 gloo ranks (Kendall tau).

    PYTHONPATH=. .venv/bin/python benchmarks/verify_kendall.py [--steps 5] [--rounds 5] [--no-calibrate]

For each case autoplan plans a small Llama on a 4-rank mesh (tp 4, dp 2 x tp 2, dp 4; sequence
parallel forced on/off; replicated units allowed or not; two batch shapes) with the measured
``cpu`` profile, and :func:`autoplan.verify.measured.measure` runs the plan on 4 gloo ranks:
numerics vs one device once, then the median step time (slowest rank per step) in each of
``rounds`` passes over all plans, keeping each plan's fastest pass (drops passes slowed by other
processes on this shared host). Each plan is priced twice: with this host's runtime calibration
(``cost_models.runtime``, re-measured at the start unless ``--no-calibrate``) and with the bare
cpu profile (no calibration), so the effect of the calibration is visible.

Writes benchmarks/results/verify_kendall.{csv,md,png}.
"""
from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

import pandas as pd
import torch

MODEL = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, ffn_hidden=384, max_seq_len=128)
OUT = Path(__file__).resolve().parent / "results"

# name, mesh shape, mesh names, (global batch, seq), autoplan keyword arguments
CASES = [
    ("tp4_replicated_ok", (4,), ("tp",), (4, 32), dict()),
    ("tp4_sharded", (4,), ("tp",), (4, 32), dict(allow_replicated_units=False, sequence_parallel=False)),
    ("tp4_sharded_sp", (4,), ("tp",), (4, 32), dict(allow_replicated_units=False, sequence_parallel=True)),
    ("tp4_sharded_b8s64", (4,), ("tp",), (8, 64), dict(allow_replicated_units=False, sequence_parallel=False)),
    ("dp2tp2_sharded", (2, 2), ("dp", "tp"), (4, 32), dict(allow_replicated_units=False, sequence_parallel=False)),
    ("dp2tp2_sharded_sp", (2, 2), ("dp", "tp"), (4, 32), dict(allow_replicated_units=False, sequence_parallel=True)),
    ("dp2tp2_replicated_ok", (2, 2), ("dp", "tp"), (4, 32), dict()),
    ("dp4_fsdp", (4, 1), ("dp", "tp"), (4, 32), dict()),
]


def kendall_tau(x, y) -> float:
    """Kendall tau-b (ties in either list handled), O(n^2): no scipy needed."""
    conc = disc = tx = ty = 0
    for (a1, b1), (a2, b2) in itertools.combinations(list(zip(x, y)), 2):
        dx, dy = a1 - a2, b1 - b2
        if dx == 0 and dy == 0:
            continue
        if dx == 0:
            tx += 1
        elif dy == 0:
            ty += 1
        elif (dx > 0) == (dy > 0):
            conc += 1
        else:
            disc += 1
    denom = math.sqrt((conc + disc + tx) * (conc + disc + ty))
    return (conc - disc) / denom if denom else float("nan")


def plan_case(shape, names, batch, kw, calibrated: bool):
    """The plan on the cpu profile; ``calibrated=False``: the profile as it was before any
    calibration (no runtime overheads, loopback-guess links), for comparison."""
    import cost_models.hardware as hw_mod
    import cost_models.runtime as rt_mod
    from autoplan import ParallelDims, autoplan
    from autoplan.models import build_llama
    from cost_models.hardware import Link

    model = build_llama(device="meta", **MODEL)
    saved_rt, saved_hw = rt_mod.load_runtime, hw_mod.load_hardware

    def bare_hardware(name, **k):
        h = saved_hw(name, **k)
        if h.name != "cpu":
            return h
        loop = Link("loopback_gloo", bandwidth=2e9, latency=50e-6)   # measure_host_profile's guess
        return h.with_overrides(intra_node=loop, inter_node=loop)

    if not calibrated:
        rt_mod.load_runtime = lambda world: None
        hw_mod.load_hardware = bare_hardware
    try:
        return autoplan(model, ParallelDims(shape, names, "cpu"), batch=batch, dtype=torch.float32, **kw)
    finally:
        rt_mod.load_runtime, hw_mod.load_hardware = saved_rt, saved_hw


def priced_as_listed(plan) -> float:
    """Diagnostic: the plan's step with every collective priced from the plan's own collective
    listing (what the runtime issues: one FSDP all-gather / reduce-scatter per FSDP unit, i.e. per
    block and the root) instead of the search's per-unit FSDP pricing (attention, MLP and norms
    each pay a collective's latency). Same cost context, same exposed-dp overlap rule."""
    from autoplan.search.pricing.costing import CostContext
    from cost_models.hardware import load_hardware
    from cost_models.topology import mesh_topology
    from hyper_parallel.core.collective import Collective
    from hyper_parallel.parallel_dims import ParallelDims
    from autoplan.search.tp.search import exposed_dp

    spec = ParallelDims.from_dict(plan.mesh)
    dp = spec.degree(plan.dp_dim) if plan.dp_dim else 1
    ctx = CostContext(hardware=load_hardware(spec.hardware), topology=mesh_topology(spec), dtype="torch.float32",
                      tp_dim=plan.tp_dim or "tp", dp_dim=plan.dp_dim, dp=dp, fsdp=bool(plan.fsdp.get("enabled")),
                      param_bytes_per_element=4, optimizer_bytes_per_element=8)
    tp_comm = dp_comm = 0.0
    for r in plan.predictions["collectives"]:
        t = ctx.collective_time(Collective(r["kind"], r["phase"], r["bytes"], r["count"], dim=r["mesh_dim"]))
        if r["mesh_dim"] == plan.tp_dim:
            tp_comm += t
        else:
            dp_comm += t
    compute = plan.predictions["compute_s"]
    return compute + tp_comm + exposed_dp(dp_comm, compute)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-calibrate", action="store_true")
    args = ap.parse_args(argv)

    from autoplan.verify.measured import measure
    from cost_models.runtime import calibrate_runtime, load_runtime
    from hyper_parallel.local import RankPool
    from tests.verify.measured_workers import tiny_llama

    import os

    t_start = time.time()
    load_start = os.getloadavg()[0]
    rows = {}
    with RankPool(4, timeout_s=900) as pool:
        if not args.no_calibrate:
            calibrate_runtime(4, pool=pool)
        rt = load_runtime(4)
        print("runtime calibration:", rt)
        plans = {}
        for name, shape, names, batch, kw in CASES:
            plans[name] = plan_case(shape, names, batch, kw, calibrated=True)
            bare = plan_case(shape, names, batch, kw, calibrated=False)
            p = plans[name]
            rows[name] = {
                "plan": name, "mesh": "x".join(f"{n}{s}" for n, s in zip(names, shape)), "global_batch": batch[0],
                "seq": batch[1], "stream": p.stream_layout, "loss_parallel": p.loss_parallel,
                "fsdp": bool(p.fsdp.get("enabled")), "sharded_units": sum(1 for d in p.decisions
                                                                          if d["strategy"] not in ("replicate",)),
                "collectives_per_step": int(sum(c["count"] for c in p.predictions["collectives"])),
                "predicted_step_s": p.step_time, "predicted_compute_s": p.predictions["compute_s"],
                "predicted_comm_s": p.predictions["comm_s"], "predicted_bare_step_s": bare.step_time,
                "bare_same_plan": bare.styles == p.styles, "predicted_as_listed_s": priced_as_listed(p),
                "measured_step_s": float("inf"), "round_step_s": [],
            }
        for rnd in range(args.rounds):
            for name, shape, names, batch, kw in CASES:
                frame = measure(plans[name], tiny_llama, MODEL, pool=pool, steps=args.steps, warmup=2,
                                numerics=(rnd == 0))
                r = rows[name]
                step = float(frame["measured_step_s"].iloc[0])
                r["round_step_s"].append(round(step, 5))
                r["measured_step_s"] = min(r["measured_step_s"], step)
                if rnd == 0:
                    r["numerics_ok"] = bool(frame["numerics_ok"].all())
                    r["loss_rel_err"] = float(frame["loss_rel_err"].max())
                    r["grad_max_rel_err"] = float(frame["grad_max_rel_err"].max())
                    r["measured_peak_bytes"] = int(frame["measured_peak_bytes"].max())
                    r["predicted_peak_bytes"] = float(frame["predicted_peak_bytes"].iloc[0])
                    r["measured_static_bytes"] = int(frame["measured_static_bytes"].max())
                    r["predicted_static_bytes"] = float(frame["predicted_static_bytes"].iloc[0])
                print(f"round {rnd} {name}: measured {step * 1e3:.1f} ms, predicted {r['predicted_step_s'] * 1e3:.1f} ms",
                      flush=True)
    df = pd.DataFrame(rows.values())
    df["round_step_s"] = df["round_step_s"].map(lambda v: ";".join(map(str, v)))
    df["ratio_measured_over_predicted"] = df["measured_step_s"] / df["predicted_step_s"]
    df["ratio_measured_over_bare"] = df["measured_step_s"] / df["predicted_bare_step_s"]
    tau = kendall_tau(df["predicted_step_s"], df["measured_step_s"])
    tau_bare = kendall_tau(df["predicted_bare_step_s"], df["measured_step_s"])
    tau_listed = kendall_tau(df["predicted_as_listed_s"], df["measured_step_s"])
    rounds = [[float(v) for v in s.split(";")] for s in df["round_step_s"]]
    tau_rounds = [kendall_tau([r[i] for r in rounds], df["predicted_step_s"]) for i in range(args.rounds)]
    tau_between = kendall_tau([r[0] for r in rounds], [r[-1] for r in rounds]) if args.rounds > 1 else float("nan")
    OUT.mkdir(parents=True, exist_ok=True)
    df.to_csv(OUT / "verify_kendall.csv", index=False)
    _plot(df, tau, tau_bare)
    args.load = (load_start, os.getloadavg()[0])
    _markdown(df, rt, tau, tau_bare, tau_listed, tau_rounds, tau_between, args, time.time() - t_start)
    print(df[["plan", "predicted_step_s", "predicted_bare_step_s", "measured_step_s", "numerics_ok"]].to_string())
    print(f"Kendall tau (calibrated) = {tau:.3f}; bare cpu profile = {tau_bare:.3f}; as listed = {tau_listed:.3f}; "
          f"per round {tau_rounds}")
    return 0


def _plot(df, tau, tau_bare) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5.5))
    ax.scatter(df["predicted_step_s"] * 1e3, df["measured_step_s"] * 1e3, label=f"calibrated (tau={tau:.2f})")
    ax.scatter(df["predicted_bare_step_s"] * 1e3, df["measured_step_s"] * 1e3, marker="x", color="grey",
               label=f"bare cpu profile (tau={tau_bare:.2f})")
    for _, r in df.iterrows():
        ax.annotate(r["plan"], (r["predicted_step_s"] * 1e3, r["measured_step_s"] * 1e3), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    lo = min(df["predicted_bare_step_s"].min(), df["predicted_step_s"].min(), df["measured_step_s"].min()) * 1e3 * 0.7
    hi = max(df["predicted_step_s"].max(), df["measured_step_s"].max()) * 1e3 * 1.4
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="measured = predicted")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted step time (ms)")
    ax.set_ylabel("measured step time (ms, 4 gloo ranks)")
    ax.set_title("autoplan: predicted vs measured step time, 8 plans of one Llama")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "verify_kendall.png", dpi=120)


def _markdown(df, rt, tau, tau_bare, tau_listed, tau_rounds, tau_between, args, elapsed) -> None:
    cols = ["plan", "mesh", "global_batch", "seq", "stream", "fsdp", "collectives_per_step", "predicted_step_s",
            "predicted_bare_step_s", "predicted_as_listed_s", "measured_step_s", "round_step_s", "ratio_measured_over_predicted",
            "numerics_ok"]
    show = df[cols].copy()
    for c in ("predicted_step_s", "predicted_bare_step_s", "predicted_as_listed_s", "measured_step_s"):
        show[c] = (show[c] * 1e3).round(1)
    show = show.rename(columns={"predicted_step_s": "predicted_ms", "predicted_bare_step_s": "bare_profile_ms",
                                "measured_step_s": "measured_ms", "predicted_as_listed_s": "as_listed_ms", "ratio_measured_over_predicted": "meas/pred"})
    show["meas/pred"] = show["meas/pred"].round(2)
    text = f"""# Predicted vs measured step time on 4 gloo ranks (Kendall tau)

`benchmarks/verify_kendall.py --steps {args.steps} --rounds {args.rounds}`, {time.strftime('%Y-%m-%d %H:%M')},
{elapsed:.0f} s. Model: Llama {MODEL}; fp32, AdamW. 8 plans from `autoplan` on the `cpu` profile;
each run by `autoplan.verify.measured.measure` on 4 gloo ranks (numerics vs one device checked
once per plan: all pass = {bool(df['numerics_ok'].all())}).

**Kendall tau (predicted vs measured step time) = {tau:.3f}** (target >= 0.8).
With the bare cpu profile (no runtime calibration): tau = {tau_bare:.3f}.
Diagnostic `as_listed_ms` (FSDP collectives priced per FSDP unit as the plan lists and the runner
issues them, instead of per planner unit; see below): tau = {tau_listed:.3f}.
Per measurement round (each round alone vs predicted): {', '.join(f'{t:.3f}' for t in tau_rounds)};
tau between the first and last round's measurements: {tau_between:.3f} (the noise floor).

Runtime calibration used (`cost_models.runtime`, measured on 4 concurrent gloo ranks just before):
op {rt.op_s * 1e6:.1f} us/kernel, DTensor +{rt.dtensor_op_s * 1e6:.1f} us/kernel, GEMM time x{rt.compute_scale:.2f},
streaming time x{rt.memory_scale:.2f} (vs the profile's whole-host DRAM rate),
gloo alpha {rt.link.latency * 1e6:.0f} us/step, {rt.link.bandwidth / 1e9:.2f} GB/s, +{rt.collective_s * 1e3:.2f} ms per DTensor collective.

{show.to_markdown(index=False)}

![predicted vs measured](verify_kendall.png)

## How to read this; noise

- The host has 2 CPU cores shared with other engineers' jobs (1-minute load average
  {args.load[0]:.1f} at the start of this run, {args.load[1]:.1f} at the end). 4 ranks with one thread each already oversubscribe it 2x; every extra process changes
  both compute speed and gloo latency (a collective completes only once all 4 ranks are scheduled).
  The calibration is a snapshot of the load at the time it ran; step times are each plan's fastest
  of {args.rounds} rounds of a {args.steps}-step median (slowest rank per step). Absolute errors of
  tens of percent are expected here; the ranking is what the planner needs.
- `bare_profile_ms` is the cpu profile as it was before this calibration existed (roofline +
  1 us kernels + a guessed 50 us / 2 GB/s loopback link): it is an order of magnitude low, because on this host a step is dominated by
  per-op eager/DTensor dispatch and by gloo latency under oversubscription, neither of which a
  roofline sees.
- FSDP plans: the search prices FSDP all-gathers/reduce-scatters once per planner unit
  (attention, MLP and norms of a block each pay a collective latency), while the runner wraps whole
  blocks (one collective per block and one for the root). Bytes are the same; on gloo with
  ~0.5 ms per ring step plus ~2-3 ms per collective in an eager step, the 3x latency count
  over-prices FSDP plans (dp4_fsdp, dp2tp2_*). `as_listed_ms` prices the plan's own collective
  listing with the same context; the fix belongs in the search (autoplan/search/tp/search.py).
- The optimizer step (AdamW; ~7-25 ms here, mostly per-DTensor-parameter dispatch) is not in the
  search's step time yet: `CostContext.optimizer_time` prices it but nothing calls it.
- Plans that differ by less than the round-to-round spread (see `round_step_s`) can swap places
  between runs; tau over 8 plans moves by 0.07 per swapped pair.
"""
    (OUT / "verify_kendall.md").write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
