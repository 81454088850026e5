"""Speed of verify(): the Llama-3-70B-shape plan for 512 H100s (dp=64 x tp=8) dry-run on this CPU
(fake process group of 512 ranks, fake tensors), predicted vs issued collectives compared exactly.
Writes benchmarks/results/verify_scale.md.

    .venv/bin/python benchmarks/verify_scale.py [--layers 80]
"""
from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from autoplan import ParallelDims, autoplan
from autoplan.models import build_llama
from autoplan.verify import verify

OUT = Path(__file__).parent / "results" / "verify_scale.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=80)
    args = ap.parse_args(argv)
    model = build_llama(device="meta", dim=8192, n_layers=args.layers, n_heads=64, n_kv_heads=8,
                        vocab_size=128256, ffn_hidden=28672, max_seq_len=8192)
    t0 = time.perf_counter()
    plan = autoplan(model, ParallelDims((64, 8), ("dp", "tp"), "h100_sxm"), batch=(512, 8192))
    t1 = time.perf_counter()
    result = verify(plan, model)
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    df = result.collectives
    text = (f"# verify() at world 512: Llama-3-70B shape ({args.layers} layers), dp=64 x tp=8, batch 512 x 8192\n\n"
            f"- plan: {t1 - t0:.2f} s; **verify (apply + fake forward/backward + compare): {t2 - t1:.2f} s** "
            f"(target < 30 s); peak RSS {peak:.0f} MB\n"
            f"- passed: **{result.passed}**; parameter bytes per rank predicted {result.param_bytes['predicted']:,} "
            f"vs issued {result.param_bytes['issued']:,}\n"
            f"- plan: stream {plan.stream_layout}, loss parallel {plan.loss_parallel}, activation checkpointing "
            f"{plan.activation_checkpointing}, FSDP {plan.fsdp['enabled']}\n\n"
            f"{df.to_markdown(index=False)}\n")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text)
    return 0 if result.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
