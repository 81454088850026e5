"""Rank functions for tests/train/test_moe_pretrained.py: a save_pretrained MoE directory (one file
tensor per expert) loaded into a plan's shards, counting the bytes each rank reads from the files."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from autoplan.plan import safetensors_slices
from autoplan.plan.hf_merged import read_assembled
from hyper_parallel.local import cached_mesh


@contextlib.contextmanager
def counted_reads():
    """Every ``SafetensorsFile.read`` on this rank: {"expert": bytes of expert tensors, "other": ...}."""
    counts = {"expert": 0, "other": 0, "calls": 0}
    original = safetensors_slices.SafetensorsFile.read

    def read(self, key, offsets, lengths):
        out = original(self, key, offsets, lengths)
        counts["expert" if ".experts." in key else "other"] += out.numel() * out.element_size()
        counts["calls"] += 1
        return out
    safetensors_slices.SafetensorsFile.read = read
    try:
        yield counts
    finally:
        safetensors_slices.SafetensorsFile.read = original


def load_and_step(runs: list[dict]) -> list[dict]:
    """For each run (``model``: a directory, ``plan``: a plan file): the Trainer loads the weights
    (bytes read counted), rank 0 returns the gathered parameters before any step, every rank the
    first loss and its byte counts."""
    from autoplan.train import TrainConfig, Trainer

    out = []
    for run in runs:
        with counted_reads() as counts:
            tr = Trainer(TrainConfig(model=run["model"], plan=run["plan"], batch=8, seq=16, steps=1, lr=1e-3,
                                     progress="none"))
        state = {k[len("model."):]: v for k, v in tr.gathered_state().items() if k.startswith("model.")}
        loss = tr.fit().losses[0]
        out.append({"loss": loss, "reads": dict(counts), "state": state if dist.get_rank() == 0 else None})
    return out


def refused(dirs: dict[str, tuple[str, str]]) -> dict[str, dict]:
    """Each broken directory must fail with PretrainedWeightsError in Trainer(...) on this rank with
    no tensor bytes read (the verdict comes from the headers)."""
    from autoplan.errors import PretrainedWeightsError
    from autoplan.train import TrainConfig, Trainer

    out = {}
    for case, (path, plan) in dirs.items():
        with counted_reads() as counts:
            try:
                Trainer(TrainConfig(model=path, plan=plan, batch=8, seq=16, steps=1, progress="none"))
                out[case] = {"error": None}
            except PretrainedWeightsError as e:
                out[case] = {"error": type(e).__name__, "name": e.name, "expected": e.expected, "found": e.found,
                             "message": str(e)}
        out[case]["bytes"] = counts["expert"] + counts["other"]
    return out


def placements_read(path: str, shape: tuple[int, ...], names: tuple[str, ...], cases: dict) -> dict:
    """read_assembled into DTensors of the given placements (expert TP: each rank a slice of the gate
    and of the up half, a strided shard; down split on the ffn dim): each rank's local
    tensor must equal ``distribute_tensor`` of the fused tensor ``from_pretrained`` builds."""
    import transformers

    from autoplan.plan.pretrained import by_model_names, read_headers
    from autoplan.plan.safetensors_slices import SafetensorsFile
    from autoplan.plan.weights import ModelInit

    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    stored = read_headers(path)
    _, _, merged = by_model_names(ModelInit.of(meta), stored, path)
    mesh = cached_mesh(shape, names)
    out = {}
    for case, (name, placements) in cases.items():
        full = ref[name]
        target = distribute_tensor(torch.full_like(full, float("nan")), mesh, placements, src_data_rank=None)
        files = {f: SafetensorsFile(f"{path}/{f}") for f in {v[2] for v in stored.values()}}
        with counted_reads() as counts:
            read_assembled(target, merged[name], files, {k: v[2] for k, v in stored.items()})
        for f in files.values():
            f.close()
        want = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        got = target.to_local() if isinstance(target, DTensor) else target
        out[case] = {"equal": bool(torch.equal(got, want)), "bytes": counts["expert"],
                     "local_bytes": got.numel() * 4, "calls": counts["calls"]}
    return out
