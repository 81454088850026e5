"""Expert-parallel plans for MoE shapes on 8-64 H100s (h100_sxm, 80 GB): GPT-OSS-20B and
Mixtral-8x7B (presets from their published configs), fixed meshes with an ep dimension, batch
(global) x 4096 tokens, bf16 with fp32 master weights and AdamW. For each mesh: the expert
option the planner picked (ExpertParallel, + expert TP, or replicated experts with ep as data
parallel), predicted step time, memory per rank against the usable limit, and the
all-to-all bytes per step. Infeasible meshes say their minimum. With ``--verify`` the first
feasible expert-parallel plan at world 64 of each model is also dry-run at its world size (balanced routing)
and predicted == issued is reported.
Writes benchmarks/results/moe_plans.md.

    .venv/bin/python benchmarks/moe_plans.py [--layers N] [--verify]
    .venv/bin/python benchmarks/moe_plans.py --deepseek     # DeepSeek-V3 on 2048 H800s -> moe_deepseek_v3.md
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from autoplan import autoplan
from autoplan.errors import InfeasiblePlanError
from autoplan.mesh_plan import plan_mesh
from autoplan.request import PlanRequest
from autoplan.search.experts.search import DEEPSEEK_V3_RUNTIME, OUR_EXPERT_RUNTIME
from autoplan.search.mesh.search import ClusterSearch
from autoplan.presets import build_preset
from autoplan.verify import verify
from cost_models.hardware import load_hardware
from hyper_parallel import ParallelDims

LIMIT = float(load_hardware("h100_sxm").usable_memory())
OUT = Path(__file__).parent / "results" / "moe_plans.md"
OUT_DS = Path(__file__).parent / "results" / "moe_deepseek_v3.md"
DS_SCHEDULES = ["1F1B", "ZBV"]   # ZBV: the closest of ours to DeepSeek's DualPipe
DS_BATCH = (15360, 4096)   # DeepSeek-V3 pre-training: batch 15,360 sequences of 4K tokens (final)
MESHES = [((8,), ("ep",)), ((2, 4), ("dp", "ep")), ((4, 2), ("ep", "tp")), ((2, 8), ("dp", "ep")),
          ((4, 8), ("dp", "ep")), ((2, 8, 2), ("dp", "ep", "tp")), ((8, 8), ("dp", "ep")),
          ((4, 8, 2), ("dp", "ep", "tp"))]


READING = """
## Reading

- Every feasible mesh plans ep > 1 with ExpertParallel (expert TP where the mesh has tp): replicated experts lose
  on memory (GPT-OSS-20B: 21B parameters, 16 bytes each with AdamW and fp32 master weights) and on the
  all-reduce of their gradients over ep.
- Mixtral-8x7B (46.7B parameters, ~700 GiB of weights + gradients + AdamW state) cannot train on 8 H100s (640 GB
  in all) with any layout; on dp x ep8 meshes every rank holds one expert of each layer and FSDP2 shards
  dim 0 of the local expert weights over dp -- one row over 2-8 ranks pads to a whole expert per rank, so the
  expert state does not shrink with dp (the planner prices this padding; sharding the local experts on another
  dimension, as torchtitan does when dp x ep exceeds E, would fix it). With expert TP (ep8 x tp2) it fits.
- "infeasible: min" is the least memory any plan of that mesh needs (experts at their smallest option).
- Step times are the cost model's (h100_sxm profile), routing imbalance factor 1.0 (balanced).
"""


DS_DOC = """DeepSeek-V3 (671B: 61 layers, the first 3 dense, MLA attention, 256 routed experts top-8 + 1 shared
expert; the preset ``deepseek-v3``, on meta) on 2,048 H800s (the ``h800`` profile: H100 compute, NVLink 200 GB/s
per direction, InfiniBand 50 GB/s per GPU), global batch 15,360 x 4,096 tokens, bf16 with fp32 master weights and
AdamW. ``autoplan(model, 2048)`` searches dp x pp x tp, data-parallel mode, recomputation, micro-batches and
schedule, and ep (borrowed from dp, with or without a pipeline). The published layout (EP64, PP16, ZeRO-1, no TP:
DeepSeek-V3 technical report, section 3.2) is priced by the same search's ``evaluate`` on 1F1B and on ZBV (the
closest of our schedules to DualPipe), even and balanced cuts, recomputation at its fastest -- twice: as
hyper_parallel's runtime would run it (every routed copy over the ep link, all-to-alls exposed) and as DeepSeek's
runtime ran it (``experts.search.DEEPSEEK_V3_RUNTIME``: node-limited routing to <= 4 nodes, DualPipe hiding the
all-to-alls behind the other chunk's compute; the report's 19.9 s per step is the measurement to hold it to)."""


def _ds_row(label, c, note=""):
    ch = c.choice
    mesh = " x ".join(f"{k}{v}" for k, v in c.mesh.items())
    return (f"| {label} | {mesh} | {c.dp_mode} | {c.recompute} | {ch.schedule} m={ch.m} | {c.step_s:.2f} | "
            f"{max(ch.rank_memory) / 2**30:.1f} | {ch.bubble_fraction:.3f} | {note} |")


def deepseek(layers: int | None = None) -> str:
    """The DeepSeek-V3 section: autoplan's choice, its runners-up with ep, the published layout priced."""
    model = build_preset("deepseek-v3", num_layers=layers)
    t = time.perf_counter()
    plan = autoplan(model, 2048, batch=DS_BATCH, hardware="h800")
    dt = time.perf_counter() - t
    mesh = dict(zip(plan.mesh["names"], plan.mesh["shape"]))
    pipe = plan.pipeline
    out = [f"# DeepSeek-V3 on 2,048 H800s\n\n{DS_DOC}\n",
           f"## autoplan's choice: {mesh}, {plan.fsdp.get('mode')} data parallel, recompute "
           f"{plan.parallel['ac']['mode']}, {pipe['schedule']} with {pipe['microbatches']} micro-batches of "
           f"{pipe['microbatch_size']}\n",
           f"predicted **{plan.predictions['step_s']:.2f} s/step**, {plan.predictions['memory_bytes']['total'] / 2**30:.1f} "
           f"GiB on the fullest rank, bubble {pipe['bubble_fraction']:.3f}; experts: "
           f"{'expert parallel ' + str(plan.parallel['ep']['styles']) if plan.parallel.get('ep') else 'replicated (no ep dimension)'}; "
           f"**planning time {dt:.1f} s** (search {plan.timing['search_s']:.1f} s)\n",
           "Runners-up (best per mesh / schedule / dp mode):\n", "| name | step s | GiB/rank |", "|:--|--:|--:|"]
    out += [f"| {a['name']} | {a['step_s']:.2f} | {a['memory_bytes'] / 2**30:.1f} |" for a in plan.alternatives[:8]]
    out += ["", "## The published layout priced beside it\n",
            "| layout | runtime | mesh | dp mode | recompute | schedule | step s | GiB/rank | bubble | note |",
            "|:--|:--|:--|:--|:--|:--|--:|--:|--:|:--|"]
    best = {}
    # ours: recomputation the search's fastest that fits 80 GB; DeepSeek's: each mode, memory not
    # limited -- the report recomputes only RMSNorm and the MLA up-projections and caches activations in
    # FP8 (sec. 3.3), neither priced, so our memory count of their run is above what it used
    for label, runtime, acs, limit in (("ours", OUR_EXPERT_RUNTIME, (None,), None),
                                       ("DeepSeek's", DEEPSEEK_V3_RUNTIME, ("none", "selective", "full"), 1e30)):
        search = ClusterSearch.of(model, 2048, hardware="h800", batch=DS_BATCH, microbatch_sizes=(1,),
                               expert_runtime=runtime, memory_limit=limit)
        for sched, cuts, ac in ((x, y, z) for x in DS_SCHEDULES for y in ("even", "balanced") for z in acs):
            try:
                c = search.evaluate(dict(dp=2, pp=16, tp=1, ep=64), sched, 1, "zero1", ac, cuts=cuts)
            except InfeasiblePlanError as e:
                out.append(f"| published EP64 PP16 ZeRO-1 | {label} | dp2 x ep64 x pp16 x tp1 | zero1 | - | {sched} "
                           f"| - | - | - | {cuts} cuts: {e} |")
                continue
            out.append(_ds_row(f"published EP64 PP16 ZeRO-1 | {label}", c, f"{cuts} cuts"))
            if label not in best or c.step_s < best[label][1].step_s:
                best[label] = (search, c)
    a2a = {}
    for label, (search, c) in best.items():
        units, _ = search.unit_costs(c.dp, c.pp, c.tp, c.dp_mode, c.recompute, 1, ep=64)
        dense, _ = search.unit_costs(c.dp * 64, c.pp, c.tp, c.dp_mode, c.recompute, 1)
        a2a[label] = (sum(u.forward + u.backward_input for u in units) - sum(u.forward + u.backward_input
                                                                             for u in dense)) * c.choice.m / c.pp
    step = plan.predictions["step_s"]
    ours = best.get("ours", (None, None))[1]
    theirs = best.get("DeepSeek's", (None, None))[1]
    ep_alt = [a for a in plan.alternatives if a["mesh"].get("ep", 1) > 1]
    out += ["", "## Reading\n",
            f"- The published layout as DeepSeek's runtime ran it: **{theirs.step_s:.2f} s/step** against 19.9 s "
            f"measured (ratio {theirs.step_s / 19.9:.3f}; recompute {theirs.recompute}, "
            f"{max(theirs.choice.rank_memory) / 2**30:.0f} GiB by our count; bf16 GEMMs -- their FP8 GEMMs and FP8 "
            "activation caching are not priced)."
            if theirs else "- The published layout could not be priced with DeepSeek's runtime.",
            f"- The same layout as hyper_parallel's runtime would run it: {ours.step_s:.2f} s/step; autoplan's choice "
            f"(for our runtime) {step:.2f} s/step." if ours else "",
            "- Why autoplan's choice is not the published layout, a term a reviewer can check: the expert "
            "all-to-alls (``ep_term``: what ep adds on the busiest pipeline rank against the same plan with ep folded "
            "into dp, all-to-alls minus the expert weights a rank no longer reads) are "
            + ", ".join(f"{v:.1f} s per step with {'our' if k == 'ours' else k} runtime" for k, v in a2a.items())
            + ". hyper_parallel's runtime sends every routed copy (top-8, no per-node de-duplication) and does "
            "not overlap the all-to-alls with compute (the plan's notes say so), so on it the published layout pays "
            "them in full; DualPipe hides them, which is why the same layout is fast for DeepSeek."
            + (f" The best ep plan the search priced: {ep_alt[0]['name']} at {ep_alt[0]['step_s']:.1f} s."
               if ep_alt else " No ep plan was among the runners-up."),
            "- Predicted step times are the cost model's (datasheet H800, alpha-beta links, attention at the "
            "FlashAttention-3 efficiency, routing imbalance 1.0), not measurements."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None, help="override the depth (default: the preset's)")
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--deepseek", action="store_true", help="only DeepSeek-V3 on 2048 H800s (moe_deepseek_v3.md)")
    args = ap.parse_args(argv)
    if args.deepseek:
        OUT_DS.write_text(deepseek(args.layers))
        print(OUT_DS.read_text())
        return 0
    lines = []
    for preset in ("gpt-oss-20b", "mixtral-8x7b"):
        model = build_preset(preset, num_layers=args.layers)
        verified = not args.verify
        lines += [f"\n## {preset}\n", f"| mesh | world | global batch | experts | step s | memory GiB (limit {LIMIT / 2**30:.0f}) | "
                  "all-to-all MB/step | fits | plan s |", "|---|---|---|---|---|---|---|---|---|"]
        for shape, names in MESHES:
            spec = ParallelDims(shape, names, hardware="h100_sxm")
            world = spec.world_size
            shards = world // (dict(zip(names, shape)).get("tp", 1))
            batch = (max(shards, 8) * 1, 4096)
            mesh = "x".join(f"{n}{s}" for n, s in zip(names, shape))
            t = time.perf_counter()
            try:
                plan = plan_mesh(model, spec, PlanRequest.for_mesh("plan_mesh", hardware=spec.hardware, batch=batch))
            except InfeasiblePlanError as e:
                need = str(e).split("minimum is ")[-1].split(" per rank")[0]
                lines.append(f"| {mesh} | {world} | {batch[0]} | - | - | infeasible: min {need} | - "
                             f"| no | {time.perf_counter() - t:.1f} |")
                continue
            dt = time.perf_counter() - t
            ep_rows = [d for d in plan.decisions if d["unit"].endswith("/experts")]
            choice = ",".join(sorted({d["strategy"] for d in ep_rows})) or "-"
            mem = plan.predictions["memory_bytes"]["total"] / 2**30
            a2a = sum(r["bytes"] * r["count"] for r in plan.predictions["collectives"] if r["kind"] == "all_to_all")
            lines.append(f"| {mesh} | {world} | {batch[0]} | {choice} | {plan.predictions['step_s']:.3f} | "
                         f"{mem:.1f} | {a2a / 1e6:.1f} | {'yes' if mem * 2**30 <= LIMIT else 'NO'} | {dt:.1f} |")
            if not verified and world == 64 and plan.parallel["ep"]["styles"]:
                t = time.perf_counter()
                # HF models keep a KV cache in forward: under full recomputation the recomputed forward
                # appends to it again (keys twice as long); training never reads it
                model.config.use_cache = False
                r = verify(plan, model)
                verified = True
                lines.append(f"\nverify ({mesh}, world {world}): passed={r.passed}, "
                             f"{len(r.collectives)} collective rows, {time.perf_counter() - t:.1f} s"
                             + (f", error: {r.error}" if r.error else "") + "\n")
            print(lines[-1], flush=True)
    OUT.write_text("# MoE plans on H100s (h100_sxm)\n\n" + __doc__.split("Writes")[0].strip() + "\n" + "\n".join(lines)
                   + "\n" + READING)
    print(OUT.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
