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
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from autoplan.errors import InfeasiblePlanError
from autoplan.mesh_plan import plan_mesh
from autoplan.presets import build_preset
from autoplan.verify import verify
from cost_models.hardware import load_hardware
from hyper_parallel import ParallelDims

LIMIT = float(load_hardware("h100_sxm").usable_memory())
OUT = Path(__file__).parent / "results" / "moe_plans.md"
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None, help="override the depth (default: the preset's)")
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args(argv)
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
                plan = plan_mesh(model, spec, batch=batch)
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
