"""Planning Qwen2.5-VL-7B- and -72B-shaped models on 8 and 64 H100s from a cold start, on meta.

The models are built on meta from the published configurations' numbers, typed here (no
download). 7B decoder: hidden 3584, 28 layers, 28 heads, 4 KV heads, MLP 18944; 72B decoder:
hidden 8192, 80 layers, 64 heads, 8 KV heads, MLP 29568; both: vocabulary 152064, M-RoPE sections
16/24/24, and the same vision tower (32 blocks of width 1280, 16 heads, MLP 3420, 14-pixel patches
merged 2x2, 112-pixel windows with full attention in blocks 7/15/23/31) projecting to the decoder
width. No hook: the image inputs (224-pixel images, 64 image tokens a row) are derived from the
config (autoplan/capture/image_inputs.py, patch_grid.py).

Rows: ``plan_cluster`` free to choose every degree (the 7B on 64 GPUs picks data parallelism with
FSDP: nothing to shard at that size), and with the tensor-parallel degree fixed (``constraints=
{"tp": t}``, the rest searched) -- the plan must then shard both the tower and the decoder
(``tower`` / ``decoder``: an attention or MLP unit of each is sharded), or be refused with a typed
error (the 72B's weights, gradients and Adam state alone are over 1 TB: 8 H100s cannot train it).
Each run is a fresh
``python`` process with an empty planner disk cache (``AUTOPLAN_CACHE_DIR``), as a user's first
call pays it; the call is timed apart from the import and the build (wall and CPU seconds).

    .venv/bin/python benchmarks/vl_planning.py [--runs 3]
Writes benchmarks/results/vl_planning.csv and benchmarks/results/vl_planning.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent
ROOT = HERE.parent

# (model, devices, fixed tensor-parallel degree or None): the 7B's 28 heads split by 4, the 72B's 64 by 8
CASES = [("7b", 64, None), ("7b", 8, 4), ("7b", 64, 4), ("72b", 8, 8), ("72b", 64, 8)]

CHILD = r"""
import gc, json, sys, time
t0 = time.perf_counter()
import torch, transformers
from autoplan.cluster import plan_cluster
from autoplan.errors import InfeasiblePlanError
import_s = time.perf_counter() - t0
size, devices, tp = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
text = {"7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4),
        "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                    num_key_value_heads=8)}[size]
t0 = time.perf_counter()
config = transformers.Qwen2_5_VLConfig(
    text_config=dict(vocab_size=152064, max_position_embeddings=128000, rope_theta=1e6,
                     rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]}, **text),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                       out_hidden_size=text["hidden_size"], patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       window_size=112, fullatt_block_indexes=[7, 15, 23, 31], in_channels=3),
    image_token_id=151655)
with torch.device("meta"):
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
build_s = time.perf_counter() - t0
gc.collect(); gc.freeze()
w0, c0 = time.perf_counter(), time.process_time()
try:
    plan = plan_cluster(model, devices, hardware="h100_sxm", batch=(256, 4096),
                        constraints={"tp": tp} if tp else None)
except InfeasiblePlanError as exc:   # a typed refusal is this row's answer (the 72B's training state on 8)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    print(json.dumps(dict(import_s=import_s, build_s=build_s, wall_s=wall, cpu_s=cpu, parallel={}, sharded=[],
                          refused=f"{type(exc).__name__}: {exc}")))
    sys.exit(0)
wall, cpu = time.perf_counter() - w0, time.process_time() - c0
sharded = sorted({d["unit"] for d in plan.decisions if d["strategy"] != "replicate"})
print(json.dumps(dict(import_s=import_s, build_s=build_s, wall_s=wall, cpu_s=cpu,
                      parallel=dict(zip(plan.mesh["names"], plan.mesh["shape"]),
                                    fsdp=(plan.parallel.get("dp") or {}).get("fsdp", {}).get("enabled")),
                      sharded=sharded), default=str))
"""


def run_once(size: str, devices: int, tp: int | None) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, AUTOPLAN_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", CHILD, size, str(devices), json.dumps(tp)], env=env,
                             capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def case_row(size: str, devices: int, tp: int | None, runs: int) -> dict:
    """The median of ``runs`` cold calls, and what the plan shards (tower: the ``visual`` tower's
    attention or MLP; decoder: the language model's)."""
    done = [run_once(size, devices, tp) for _ in range(runs)]
    for r in done:
        print({k: v for k, v in r.items() if k != "sharded"}, flush=True)
    units = [u for u in done[0]["sharded"] if u.endswith(("/attention", "/mlp"))]
    options = f", constraints={{'tp': {tp}}}" if tp else ""
    return dict(call=f"plan_cluster(qwen2.5-vl-{size}, {devices}, hardware='h100_sxm', batch=(256, 4096){options})",
                runs=len(done), wall_s=round(statistics.median(r["wall_s"] for r in done), 2),
                cpu_s=round(statistics.median(r["cpu_s"] for r in done), 2),
                wall_max_s=round(max(r["wall_s"] for r in done), 2),
                import_s=round(statistics.median(r["import_s"] for r in done), 2),
                build_s=round(statistics.median(r["build_s"] for r in done), 2),
                load=round(os.getloadavg()[0], 2),
                plan=done[0].get("refused") or ", ".join(f"{k}={v}" for k, v in done[0]["parallel"].items()),
                tower=any(u.startswith("model.visual.") for u in units),
                decoder=any(u.startswith("model.language_model.") for u in units),
                sharded="; ".join(units))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    df = pd.DataFrame([case_row(size, devices, tp, args.runs) for size, devices, tp in CASES])
    df.to_csv(HERE / "results" / "vl_planning.csv", index=False)
    (HERE / "results" / "vl_planning.md").write_text(
        "# Planning Qwen2.5-VL-7B- and -72B-shaped models on 8 and 64 H100s, cold, on meta\n\n"
        f"Median of {args.runs} fresh processes per row (empty planner cache); the call alone, wall and CPU "
        "seconds; `load` is the 1-minute load average of this shared machine when the row ended. `tower` / "
        "`decoder`: the plan shards an attention or MLP unit of the vision tower / the language model.\n"
        "Regenerate: `.venv/bin/python benchmarks/vl_planning.py`.\n\n" + df.to_markdown(index=False) + "\n")


if __name__ == "__main__":
    main()
