"""Capture time and memory at full model scale (meta, no weights): Llama-3 70B and 405B shapes.

Each case runs in a fresh subprocess so peak RSS is that case's alone (it includes importing
torch and transformers). Reports capture time with structure recognition (dedup: one trace per
distinct block) at the real depth and at 8 layers, and, for contrast, tracing every layer.
``capture_s`` is the first capture in the process (it pays torch.export's lazy imports and
warm-up), ``capture_again_s`` a second capture of the same model.
Writes benchmarks/capture_scale.csv and .md.

    .venv/bin/python benchmarks/capture_scale.py
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).parent
BATCH = (1, 4096)

CASES = [  # (preset, layers or None for the real depth, dedupe blocks)
    ("llama3-70b", 8, True),
    ("llama3-70b", None, True),
    ("llama3-405b", 8, True),
    ("llama3-405b", None, True),
    ("titan-llama3-70b", None, True),
    ("titan-llama3-405b", None, True),
    ("llama3-70b", 8, False),
    ("llama3-70b", None, False),
]

CHILD = r"""
import json, resource, sys, time, logging
import torch
from autoplan.capture import capture
from autoplan.presets import build_preset
name, layers, dedupe, b, s = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
t0 = time.perf_counter()
model = build_preset(name, num_layers=None if layers == "None" else int(layers), dtype=torch.bfloat16)
t1 = time.perf_counter()
g = capture(model, batch=(b, s), dedupe_blocks=dedupe)
t2 = time.perf_counter()
capture(model, batch=(b, s), dedupe_blocks=dedupe)
t3 = time.perf_counter()
att = g.blocks[0].roles.get("attention", [{}])[0] if g.blocks else {}
print(json.dumps({
    "build_s": round(t1 - t0, 2), "capture_s": round(t2 - t1, 2), "capture_again_s": round(t3 - t2, 2),
    "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    "layers": sum(bg.count for bg in g.blocks), "block_groups": len(g.blocks), "nodes": len(g.nodes),
    "params_b": round(g.num_parameters / 1e9, 2), "tflops_fwd": round(g.total_flops() / 1e12, 1),
    "n_heads": att.get("n_heads"), "n_kv_heads": att.get("n_kv_heads"), "method": g.method,
}))
"""


def run_case(name: str, layers: int | None, dedupe: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, name, str(layers), "1" if dedupe else "0", str(BATCH[0]), str(BATCH[1])],
        capture_output=True, text=True, check=True,
    )
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"preset": name, "layers_asked": layers or "full", "dedupe": dedupe, **row}


def _markdown(df: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def main() -> pd.DataFrame:
    df = pd.DataFrame([run_case(*c) for c in CASES])
    df.to_csv(HERE / "capture_scale.csv", index=False)
    header = (
        f"# Capture at scale\n\nMeta model, bf16, batch {BATCH}; one subprocess per row (peak RSS includes "
        "importing torch and transformers). `dedupe=True`: structure recognised first, one trace per "
        "distinct block; `dedupe=False`: every layer traced. `capture_s`: first capture in a fresh process "
        "(includes torch.export warm-up); `capture_again_s`: the same capture repeated. Produced by "
        "`benchmarks/capture_scale.py` on a shared 2-core CPU.\n\n"
    )
    md = _markdown(df)
    (HERE / "capture_scale.md").write_text(header + md + "\n")
    print(md)
    return df


if __name__ == "__main__":
    main()
