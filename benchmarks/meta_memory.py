"""Memory while a rank builds, shards and initialises (or loads) a model larger than its share.

Each rank of a 4-rank gloo job under torchrun constructs ``Trainer(...)`` for an HF Llama-shaped
model of 604 MB in fp32 (hidden 1024, 8 layers, vocabulary 32768) under tp=4 and dp=2 x tp=2
with FSDP, from a random init and from a ``save_pretrained`` directory. Measured on every rank:
the growth of its peak RSS during ``Trainer(...)`` (the peak is reset first through
``/proc/self/clear_refs``), beside the bytes of the parameters it holds and the plan's predicted
parameter bytes. A tiny Trainer of the same family runs first on every rank, so the process
group, the imports and the allocator's first arenas -- what any run pays whatever its model --
are not counted. The run fails when a rank grows by more than 35 % of the whole model's bytes
or by more than its shard plus the largest module's tensors plus 64 MiB: what the
design promises (a rank holds its shards and, while initialising, one module at full size).

    .venv/bin/python benchmarks/meta_memory.py          # writes results/meta_memory.{csv,md}
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks/results"
CONFIG = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=16, vocab_size=32768, tie_word_embeddings=False)
PLANS = {"tp4": dict(dp=1, tp=4, pp=1), "dp2tp2_fsdp": dict(dp=2, tp=2, pp=1, fsdp=True)}
LIMIT_OF_MODEL = 0.35
MARGIN = 64 << 20


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(model: str, plan: str, init: str, out: str) -> None:
    """One rank: warm up (the process group, the imports, one tiny Trainer of the same family: what
    any run costs whatever the model's size), reset the peak, build the Trainer, report the growth
    of the peak."""
    from torch.distributed.tensor import DTensor

    from autoplan.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=256)
    Trainer(TrainConfig(model="hf:llama", model_args=tiny, constraints={"tp": 4, "dp": 1, "pp": 1}, shard_all=True,
                        batch=4, seq=16, steps=1, progress="none", hardware="cpu"))
    Path("/proc/self/clear_refs").write_text("5")   # the peak RSS starts again from now
    before = _kib("VmRSS")
    tr = Trainer(TrainConfig(model=model, plan=plan, init=init, batch=4, seq=16, steps=1, progress="none"))
    peak = _kib("VmHWM")
    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
               for p in tr.runner.model.parameters())
    rank = tr.rank
    Path(out, f"rank{rank}.json").write_text(json.dumps({"rank": rank, "growth": peak - before, "held": held}))


def main() -> int:
    import transformers

    from autoplan import plan_cluster
    from autoplan.train.model import build_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CONFIG))
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        largest = max(sum(t.numel() * t.element_size() for t in m.parameters(recurse=False))
                      for m in model.modules())
        model.save_pretrained(tmp / "weights")
        transformers.LlamaConfig(**CONFIG).save_pretrained(tmp / "config_only")
        del model
        meta = build_model(str(tmp / "config_only"), device="meta")
        for name, cons in PLANS.items():
            plan = plan_cluster(meta, 4, hardware="cpu", batch=(4, 16), devices_per_node=4, constraints=cons,
                                allow_replicated_units=False, dtype=torch.float32)
            plan.to_json(tmp / f"{name}.json")
            predicted = int(plan.predictions["memory_bytes"]["params"])
            for init, folder in (("random", "config_only"), ("pretrained", "weights")):
                out = tmp / f"out_{name}_{init}"
                out.mkdir()
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                       __file__, "--worker", str(tmp / folder), str(tmp / f"{name}.json"), init, str(out)]
                env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
                done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{name} {init}: torchrun failed\n{done.stderr[-12000:]}")
                for f in sorted(out.glob("rank*.json")):
                    r = json.loads(f.read_text())
                    rows.append({"plan": name, "init": init, "rank": r["rank"], "model_MB": model_bytes / 1e6,
                                 "held_MB": r["held"] / 1e6, "predicted_params_MB": predicted / 1e6,
                                 "largest_module_MB": largest / 1e6, "rss_growth_MB": r["growth"] / 1e6,
                                 "growth_of_model": r["growth"] / model_bytes,
                                 "ok": r["growth"] < LIMIT_OF_MODEL * model_bytes
                                 and r["growth"] < r["held"] + largest + MARGIN})
    df = pd.DataFrame(rows)
    OUT.mkdir(exist_ok=True)
    df.to_csv(OUT / "meta_memory.csv", index=False)
    (OUT / "meta_memory.md").write_text(
        "# Peak RSS growth per rank during Trainer(...): meta build, plan, materialise or load\n\n"
        f"HF Llama-shaped, {CONFIG}, fp32; 4 gloo ranks under torchrun. Limit: growth < "
        f"{LIMIT_OF_MODEL:.0%} of the model and < held + largest module + 64 MiB. Written by "
        "`benchmarks/meta_memory.py`.\n\n" + df.to_markdown(index=False, floatfmt=".3f") + "\n")
    print(df.to_string(index=False))
    return 0 if bool(df["ok"].all()) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:6])
        sys.exit(0)
    sys.exit(main())
