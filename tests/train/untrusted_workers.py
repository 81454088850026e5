"""Rank functions for tests/train/test_untrusted_checkpoints.py (run on every rank of a gloo pool,
or in the test process as a world of one).

Each writes a real 2-step checkpoint with the Trainer, then replaces each pickled or torch-saved
file in turn by a payload that would create a marker file (tests/train/tamper.py), recomputes the
manifest, and resumes: every rank must report the same typed error naming the file, the model must
be as it was, and the marker must not exist. Last, metadata that only the ranks holding one
parameter can find wrong: every rank must still raise (the others would wait in DCP's collectives).
"""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from autoplan.train import TrainConfig, Trainer, manifest
from autoplan.train.checkpoint import TRAIN_STATE
from autoplan.train.errors import CheckpointError
from tests.train import tamper
from tests.train.train_workers import differences


def _on_rank0(fn) -> None:
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def outcome(fn) -> dict:
    """The error ``fn`` raised (type, file, message), or none; an untyped error is reported too,
    by type and first line, so that the test shows it instead of the pool failing."""
    try:
        fn()
        return {"error": None}
    except CheckpointError as e:
        return {"error": type(e).__name__, "file": getattr(e, "file", None), "message": str(e)}
    except Exception as e:  # noqa: BLE001 - the test asserts this never happens
        return {"error": type(e).__name__, "file": None, "message": str(e).splitlines()[0] if str(e) else ""}


def refusals(root: str, cfg: dict, marker: str) -> dict:
    """Train 2 steps into ``root``, then resume from the tampered step-2 once per attack; finally
    resume from it as written (it must still load)."""
    tr = Trainer(TrainConfig(steps=2, checkpoint_dir=root, **cfg))
    tr.fit()
    ck = Path(root) / "step-2"
    before = tr.gathered_state()
    files = sorted(n for n in manifest.read(ck)["files"] if n != TRAIN_STATE)   # every pickled or torch-saved file
    saved = tamper.snapshot(ck)
    byte_shard = tamper.byte_item_shard(ck)
    dist.barrier()   # every rank has read the files as written before rank 0 changes them
    out: dict = {"files": files, "cases": {}}

    def attack(label: str, file: str, tampering) -> None:
        _on_rank0(tampering)
        out["cases"][label] = dict(outcome(lambda: tr.resume(ck)), expected=file)
        _on_rank0(lambda: tamper.restore(ck, saved))

    for name in files:
        attack(f"{name} as a pickle", name, lambda name=name: tamper.as_pickle(ck, name, marker))
    attack("rng.pt as a torch.save archive", "rng.pt", lambda: tamper.as_torch_save(ck, "rng.pt", marker))
    attack("shard items as torch.save archives", byte_shard, lambda: tamper.poison_byte_items(ck, marker))
    last = list(dict(tr.model.named_parameters()))[-1]   # on the last pipeline stage only, under pp
    _on_rank0(lambda: tamper.drop_exp_avg(ck, last))
    out["seen by some ranks"] = dict(outcome(lambda: tr.resume(ck)), expected=last)
    _on_rank0(lambda: tamper.restore(ck, saved))
    out["untouched"] = not differences(before, tr.gathered_state())
    out["marker"] = Path(marker).exists()
    out["clean"] = outcome(lambda: tr.resume(ck))
    out["step"] = tr.step
    return out
