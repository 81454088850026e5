"""hyper_parallel styles vs torch's own styles: training step time on 4 gloo ranks, one run.

Both models get the same torchtitan TP+SP plan (torch's through hyper_parallel's exporter), the
same weights and batches; steps alternate between the two so machine noise hits both alike.
A step is forward + backward (loss parallel) + AdamW. Writes benchmarks/results/tp_overhead.{csv,md}.

    .venv/bin/python benchmarks/tp_overhead.py [--world 4] [--steps 30]
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

from autoplan.models import build_llama
from autoplan.models.llama_plans import torchtitan_plan
from hyper_parallel import loss_parallel, parallelize_module
from hyper_parallel.core.tensor_parallel import to_torch_plan
from hyper_parallel.local import RankPool, cached_mesh

CFG = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=1024, ffn_hidden=768, max_seq_len=128)
BATCH, SEQ = 4, 128


def _step(model, opt, tokens):
    opt.zero_grad()
    logits = model(tokens)
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
    opt.step()


def run_rank(steps: int, warmup: int = 3):
    mesh = cached_mesh((dist.get_world_size(),), ("tp",))
    ours = build_llama(seed=0, **CFG)
    theirs = build_llama(seed=0, **CFG)
    parallelize_module(ours, mesh, torchtitan_plan())
    torch_parallelize(theirs, mesh, to_torch_plan(torchtitan_plan(), theirs))
    opts = {"hyper_parallel": torch.optim.AdamW(ours.parameters(), lr=1e-4),
            "torch": torch.optim.AdamW(theirs.parameters(), lr=1e-4)}
    models = {"hyper_parallel": ours, "torch": theirs}
    tokens = torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    times = {k: [] for k in models}
    for i in range(warmup + steps):
        order = ["hyper_parallel", "torch"] if i % 2 == 0 else ["torch", "hyper_parallel"]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            _step(models[name], opts[name], tokens)
            dist.barrier()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tp_overhead"))
    args = ap.parse_args(argv)
    with RankPool(args.world, timeout_s=1800) as pool:
        per_rank = pool.run(run_rank, args.steps)
    times = per_rank[0]
    rows = []
    for name, ts in times.items():
        rows.append({"impl": name, "world": args.world, "steps": len(ts), "median_s": statistics.median(ts),
                     "mean_s": statistics.mean(ts), "min_s": min(ts), "stdev_s": statistics.stdev(ts)})
    df = pd.DataFrame(rows)
    ratio = df.set_index("impl").loc["hyper_parallel", "median_s"] / df.set_index("impl").loc["torch", "median_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out + ".csv", index=False)
    text = (f"# hyper_parallel vs torch styles, {args.world} gloo ranks (torchtitan TP+SP plan)\n\n"
            f"Model {CFG}, batch {BATCH}x{SEQ}; step = forward + backward (loss parallel) + AdamW; "
            f"alternating steps, {args.steps} measured after 3 warm-up.\n\n"
            f"{df.to_markdown(index=False, floatfmt='.4f')}\n\n**ratio hyper_parallel / torch (median): {ratio:.3f}** "
            f"(target <= 1.03)\n")
    Path(args.out + ".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
