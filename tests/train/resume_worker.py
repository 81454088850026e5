"""Run under torchrun (or plain python for one device): resume a checkpoint under other plans.

For each plan: load the checkpoint (resharded to the plan), gather every parameter and optimizer
entry and compare them bit for bit with the checkpoint read back whole (``consolidated``), then
train on to ``--until`` and record the losses. With ``--mismatch``: checkpoints of another model
must fail with CheckpointMismatchError naming the first mismatching parameter and leave the
model and optimizer as they were. Rank 0 writes the results as JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.train import CheckpointMismatchError, TrainConfig, Trainer
from autoplan.train.checkpoint import consolidated


def _differences(ref: dict, got: dict) -> list[str]:
    out = sorted(set(ref) ^ set(got))
    for k in sorted(set(ref) & set(got)):
        a, b = ref[k], got[k]
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b
        if not same:
            out.append(k)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--plans", default="")
    ap.add_argument("--until", type=int, default=25)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--mismatch-plan", default=None, help="one-device plan for the mismatch checks")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    base = dict(model="titan-llama-debug", batch=8, seq=32, steps=args.until, lr=args.lr, progress="none")
    ref = consolidated(args.checkpoint)
    results: dict = {"resume": {}, "mismatch": []}
    for plan in filter(None, args.plans.split(",")):
        tr = Trainer(TrainConfig(plan=plan, resume=args.checkpoint, **base))
        diffs = _differences(ref, tr.gathered_state())
        start = tr.step
        res = tr.fit()
        results["resume"][Path(plan).stem] = {"start": start, "entries": len(ref), "differences": diffs[:10],
                                              "losses": res.losses}
    if args.mismatch_plan:
        hf = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256)
        for model, model_args in (("titan-llama-debug", {"ffn_hidden": 256}), ("hf:llama", hf)):
            tr = Trainer(TrainConfig(**dict(base, model=model, model_args=model_args, plan=args.mismatch_plan)))
            tr.fit(1)  # optimizer state exists, so "untouched" covers it too
            before = tr.gathered_state()
            row = {"model": model, "error": None}
            try:
                tr.resume(args.checkpoint)
            except CheckpointMismatchError as e:
                row.update(error=type(e).__name__, name=e.name, message=str(e))
            row["untouched"] = not _differences(before, tr.gathered_state())
            row["step_after"] = tr.step
            results["mismatch"].append(row)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
