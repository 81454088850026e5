"""What the checkpoint manifest costs a save: DCP save without hashing, with hashing after the
write (synchronous), and with hashing in the background while the next step runs (the training
loop's way: only the part the loop waits for counts).

    PYTHONPATH=. python benchmarks/checkpoint_integrity.py [--params-m 75] [--reps 5] [--ranks 1]

A model of ``--params-m`` million fp32 parameters with AdamW state (3x that in the checkpoint,
~0.9 GB at 75M) is saved ``--reps`` times per mode, modes interleaved so a busy machine slows
them alike; the table has the median of each. ``--ranks 4`` runs the same on 4 gloo ranks (each
writes and hashes its quarter, in parallel); ``--dir /dev/shm`` saves to tmpfs (no disk noise; the
hashing is then the largest share it can be). After each save come twenty 0.5 s pauses standing
for training steps (on an accelerator the CPU is idle while a step runs); the background mode
polls after each, as the training loop does. Results: benchmarks/checkpoint_integrity.{csv,md}.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn

from autoplan.train import checkpoint
from autoplan.train.env import init_distributed
from hyper_parallel.local import RankPool

OUT = Path(__file__).resolve().parent
STEP_S, STEPS = 0.5, 20   # twenty 0.5 s "training steps" after each save


def _runner(params_m: int) -> SimpleNamespace:
    torch.manual_seed(0)
    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()   # AdamW state exists: the checkpoint is parameters + exp_avg + exp_avg_sq
    return SimpleNamespace(model=model, optimizer=opt)


def _one(mode: str, runner, root: Path, step: int) -> dict:
    """One save, then STEPS training steps of STEP_S (pauses) in every mode: the background mode
    polls after each as the training loop does and counts only the polls and the finish as
    blocking; so write-back of the previous save favours no mode."""
    dist.barrier()
    t0 = time.perf_counter()
    pending = checkpoint.begin_save(runner, root, step, {"bench": True}, integrity=mode != "no hashing")
    path = pending.finish() if mode != "hash in background" else None
    blocking = time.perf_counter() - t0
    for _ in range(STEPS):
        time.sleep(STEP_S)   # a training step ...
        dist.barrier()       # ... whose collectives leave the ranks in step (not counted: no mode saves here)
        if path is None:
            t = time.perf_counter()
            path = pending.poll()
            blocking += time.perf_counter() - t
    if path is None:
        t = time.perf_counter()
        path = pending.finish()
        blocking += time.perf_counter() - t
    size = sum(p.stat().st_size for p in path.iterdir())
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)   # keep the disk (or tmpfs) footprint to one checkpoint
    return {"mode": mode, "blocking_s": blocking, "size_mb": size / 1e6}


def measure(params_m: int, reps: int, where: str | None) -> list[dict]:
    init_distributed()
    runner = _runner(params_m)
    root = Path(tempfile.mkdtemp(prefix="ckbench-", dir=where)) if dist.get_rank() == 0 else None
    box = [str(root)]
    dist.broadcast_object_list(box, src=0)
    root = Path(box[0])
    rows = []
    modes = ["no hashing", "hash after write", "hash in background"]
    _one("no hashing", runner, root, 0)   # warm up: page cache, DCP planning caches
    for rep in range(reps):
        for k, mode in enumerate(modes[rep % 3:] + modes[:rep % 3]):
            rows.append(_one(mode, runner, root, 1 + rep * 3 + k))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params-m", type=int, default=75)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--dir", default=None, help="where to save (default: the temp dir; /dev/shm: no disk noise)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.ranks == 1:
        rows = measure(args.params_m, args.reps, args.dir)
    else:
        pool = RankPool(args.ranks, timeout_s=1800.0, pg_timeout_s=600.0)
        try:
            rows = pool.run(measure, args.params_m, args.reps, args.dir)[0]
        finally:
            pool.close()
    df = pd.DataFrame(rows)
    table = df.groupby("mode", sort=False).agg(blocking_s=("blocking_s", "median"), size_mb=("size_mb", "first"),
                                                reps=("blocking_s", "size")).reset_index()
    base = float(table.loc[table["mode"] == "no hashing", "blocking_s"].iloc[0])
    table["vs_no_hashing_pct"] = (table["blocking_s"] / base - 1) * 100
    table.insert(0, "ranks", args.ranks)
    table.insert(1, "params_m", args.params_m)
    table.insert(2, "storage", "tmpfs" if args.dir and args.dir.startswith("/dev/shm") else "disk")
    csv = OUT / "checkpoint_integrity.csv"
    old = pd.read_csv(csv) if csv.exists() else None
    if old is not None:
        old = old[~((old["ranks"] == args.ranks) & (old["params_m"] == args.params_m)
                    & (old["storage"] == table["storage"].iloc[0]))]
    full = pd.concat([old, table]) if old is not None else table
    full.to_csv(csv, index=False, float_format="%.4g")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    (OUT / "checkpoint_integrity.md").write_text(
        "# Checkpoint save: cost of the integrity manifest\n\n"
        "`PYTHONPATH=. python benchmarks/checkpoint_integrity.py --ranks R [--dir /dev/shm]` (a 2-core CPU host "
        "shared with other jobs -- load average 2 to 10 during these runs --, gloo, DCP to tmpfs or local disk; "
        "median of the reps, modes interleaved). *blocking_s*: the time the training loop waits for the save. "
        "*hash after write*: each rank CRC-32s its files right after writing them (what a synchronous save "
        "costs). *hash in background*: what the training loop does -- the same hashing in a thread while "
        "training goes on (20 pauses of 0.5 s with a barrier, standing for steps), polled after each step "
        "with one all-reduce; the save completes when every rank is done.\n\n"
        + full.to_markdown(index=False, floatfmt=".3f") + "\n")


if __name__ == "__main__":
    main()
