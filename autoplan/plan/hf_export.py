"""Trained weights out of a parallelized model as a Hugging Face directory ``from_pretrained`` loads.

Every rank writes the slices it holds and rank 0 consolidates them into full safetensors files
(torch's distributed checkpoint with ``HuggingFaceStorageWriter``, ``save_distributed`` +
``enable_consolidation``): no rank ever gathers the whole model, pipeline stages and FSDP / TP
shards are written by whoever holds them, duplicates (replicas over dp, a tied head) once. Names
are the original model's, tied tensors under their owner's name as ``save_pretrained`` writes
them; rank 0 adds the model's ``config.json``. A packed projection's strided shard (not one block
of the tensor, which DCP assumes) is first redistributed to a plain shard.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor

from autoplan.errors import InvalidArgumentError
from autoplan.plan.held import held_module
from autoplan.plan.pretrained import INDEX
from autoplan.plan.safetensors_slices import SafetensorsFile
from autoplan.plan.weights import ModelInit
from hyper_parallel.core.dtensor.blocks import as_plain_shards, holds_one_block
from hyper_parallel.core.materialize import named_tensors
from hyper_parallel.core.float8 import high_precision

log = logging.getLogger(__name__)


def export_hf(runner, out: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write what the ranks hold as a Hugging Face directory at ``out`` (collective: every rank
    calls it). ``dtype``: cast the saved tensors (e.g. ``torch.bfloat16``); default as trained."""
    facts: ModelInit | None = getattr(runner, "model_init", None)
    config = getattr(facts, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise InvalidArgumentError("export_hf: the model has no transformers config (model.config.save_pretrained); "
                                   "only transformers models can be written as a from_pretrained directory")
    out = Path(out)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        if out.exists() and any(out.iterdir()):
            raise InvalidArgumentError(f"export_hf: out={str(out)!r} exists and is not empty; give a new directory")
    state: dict[str, torch.Tensor] = {}
    for name, t in named_tensors(held_module(runner)).items():
        key = facts.file_name(name)
        if name in facts.state_shapes and key not in state:
            t = high_precision(t.detach())   # a float8-gathered weight: its high-precision values
            if isinstance(t, DTensor) and not holds_one_block(t.placements):   # DCP would write it permuted
                t = as_plain_shards(t)
            state[key] = t.to(dtype) if dtype is not None else t
    tmp = out.with_name(out.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(tmp), save_distributed=True,
                                                            enable_consolidation=True))
    if rank == 0:
        shutil.rmtree(tmp / "sharded", ignore_errors=True)
        _name_like_save_pretrained(tmp)
        config.save_pretrained(str(tmp))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    if dist.is_initialized():
        dist.barrier()
    log.info("exported the model as a Hugging Face directory: %s", out)
    return out


def _name_like_save_pretrained(folder: Path) -> None:
    """One file becomes ``model.safetensors``; several get an index, as save_pretrained writes them."""
    (folder / INDEX).unlink(missing_ok=True)   # the consolidation's own index names its part files
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        files[0].rename(folder / "model.safetensors")
        return
    weight_map = {}
    total = 0
    for f in files:
        total += f.stat().st_size
        with SafetensorsFile(str(f)) as h:
            weight_map.update({k: f.name for k in h.tensors()})
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                                           indent=2) + "\n")
