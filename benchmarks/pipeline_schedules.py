"""Step time of each pipeline schedule: hyper_parallel's runtime vs torch.distributed.pipelining.

4 gloo ranks (CPU), the repo Llama cut into the same stages for both runtimes, the same schedule
family on both sides (ZeroBubble is compared with torch's ScheduleInterleavedZeroBubble on one
stage per rank, ZBV with ScheduleZBVZeroBubble). Each runtime runs warm-up steps, then timed
steps between barriers, alternating the two runtimes so machine load hits both alike; the median
is reported with the simulator's predicted bubble for uniform stages. Numbers are from a shared
2-core machine: compare the columns with each other, not with other machines.

    .venv/bin/python benchmarks/pipeline_schedules.py [--steps 6]
Writes benchmarks/pipeline_schedules.csv and benchmarks/pipeline_schedules.md.
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from pathlib import Path

HERE = Path(__file__).parent
MODEL = dict(n_layers=8, dim=128, n_heads=8, n_kv_heads=4, vocab_size=512, ffn_hidden=384, max_seq_len=64)
BATCH, SEQ, N_MB = 16, 64, 8

log = logging.getLogger("pipeline_schedules")


def _bench(steps: int, warmup: int) -> list[dict]:
    """Runs on every rank of the pool."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining as tpp

    from autoplan.models.llama import build_llama
    from hyper_parallel.core.pipeline_parallel import SCHEDULE_NAMES, build_stages, schedule_facts

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    def theirs(name, stages):
        cls = getattr(tpp, schedule_facts(name).torch_class)
        single = issubclass(cls, tpp.schedules.PipelineScheduleSingle)   # takes one stage, not a list
        return cls(stages[0] if single else stages, N_MB, loss_fn=loss_fn)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    y = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    p = dist.get_world_size()
    rows = []
    for name in SCHEDULE_NAMES:
        facts = schedule_facts(name)
        ir = facts.ir(p, N_MB, 2)   # interleaved: two stages per rank
        runners = {}
        for label, overlap in (("ours", False), ("ours_overlap", True)):
            model = build_llama(0, **MODEL)
            st = build_stages(model, ir)
            runners[label] = (facts.schedule_class(st, N_MB, loss_fn, overlap=overlap), [s.module for s in st])
        model = build_llama(0, **MODEL)
        st = [tpp.PipelineStage(s.module, s.stage_index, s.num_stages, torch.device("cpu"))
              for s in build_stages(model, ir)]
        runners["torch"] = (theirs(name, st), [s.submod for s in st])
        times = {k: [] for k in runners}
        for i in range(warmup + steps):
            for label, (sched, mods) in runners.items():
                for m in mods:
                    m.zero_grad(set_to_none=True)
                dist.barrier()
                t0 = time.perf_counter()
                sched.step(x, target=y)
                dist.barrier()
                if i >= warmup:
                    times[label].append(time.perf_counter() - t0)
        rows.append(dict(schedule=name, **{f"{k}_ms": 1e3 * statistics.median(v) for k, v in times.items()}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import pandas as pd

    from hyper_parallel.core.pipeline_parallel import StageCost, build_schedule, simulate
    from hyper_parallel.local import RankPool

    load_before = os.getloadavg()[0]
    with RankPool(4, timeout_s=1800) as pool:
        rows = pool.run(_bench, args.steps, args.warmup)[0]
    load_after = os.getloadavg()[0]
    df = pd.DataFrame(rows)
    df["torch/ours"] = df["torch_ms"] / df["ours_ms"]
    sim = []
    for name in df["schedule"]:
        s = build_schedule(name, 4, N_MB)
        v = s.n_stages // 4
        sim.append(simulate(s, StageCost(1.0 / v, 1.0 / v, 1.0 / v)).bubble_fraction)
    df["sim_bubble_uniform"] = sim
    df = df.round(3)
    df.to_csv(HERE / "pipeline_schedules.csv", index=False)
    header = (f"4 gloo ranks (CPU, shared 2 cores), repo Llama {MODEL}, batch {BATCH}x{SEQ}, "
              f"{N_MB} micro-batches, median of {args.steps} steps after {args.warmup} warm-up; "
              f"1-min load average {load_before:.1f} before, {load_after:.1f} after (other jobs share "
              "the cores). sim_bubble_uniform: the simulator's bubble fraction for uniform stages "
              "(T_F = T_I = T_W).\n\n")
    (HERE / "pipeline_schedules.md").write_text(header + df.to_markdown(index=False) + "\n")
    log.info("%s", df.to_string(index=False))


if __name__ == "__main__":
    main()
