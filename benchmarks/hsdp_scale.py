"""HSDP at 512 H100s: the Llama-3-70B shape (torchtitan-style module names), tp=8, batch 512 x 8192.
``plan_hsdp`` prices every node-aligned dp_replicate x dp_shard split; the 8 x 8 x 8 plan is then
dry-run by ``verify`` on this CPU (fake process group of 512 ranks) and compared exactly.
Writes benchmarks/results/hsdp_scale.md.

    .venv/bin/python benchmarks/hsdp_scale.py [--layers 80]
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from autoplan.hsdp import plan_hsdp
from autoplan.models import build_llama
from autoplan.verify import verify

OUT = Path(__file__).parent / "results" / "hsdp_scale.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=80)
    args = ap.parse_args(argv)
    model = build_llama(device="meta", dim=8192, n_layers=args.layers, n_heads=64, n_kv_heads=8,
                        vocab_size=128256, ffn_hidden=28672, max_seq_len=8192)
    t0 = time.perf_counter()
    best = plan_hsdp(model, 512, tp=8, batch=(512, 8192))
    t1 = time.perf_counter()
    plan = plan_hsdp(model, 512, tp=8, batch=(512, 8192), split=(8, 8))
    t2 = time.perf_counter()
    result = verify(plan, model)
    t3 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = [(dict(zip(best.mesh["names"], best.mesh["shape"])), best.predictions["step_s"],
             best.predictions["memory_bytes"]["total"])]
    rows += [(a["name"][5:], a["step_s"], a["memory_bytes"]) for a in best.alternatives if a["name"].startswith("hsdp ")]
    table = "\n".join(f"| {m} | {s:.4f} | {b / 2**30:.1f} |" for m, s, b in rows)
    text = (f"# HSDP at world 512: Llama-3-70B shape ({args.layers} layers), tp=8, batch 512 x 8192, h100_sxm\n\n"
            f"## The split search ({t1 - t0:.1f} s for every node-aligned split)\n\n"
            f"| mesh | predicted step_s | memory GiB/rank |\n|:--|--:|--:|\n{table}\n\n"
            f"## verify of dp_replicate=8 x dp_shard=8 x tp=8 (plan {t2 - t1:.1f} s)\n\n"
            f"- **verify: {t3 - t2:.1f} s**, peak RSS {peak:.0f} MB; passed: **{result.passed}**; parameter bytes "
            f"per rank predicted {result.param_bytes['predicted']:,} vs issued {result.param_bytes['issued']:,}\n\n"
            f"{result.collectives.to_markdown(index=False)}\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)
    return 0 if result.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
