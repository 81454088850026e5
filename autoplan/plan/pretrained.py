"""Pretrained weights into a parallelized model: a Hugging Face safetensors directory.

Each rank reads only the slices it holds. The reading is torch's distributed checkpoint with its
Hugging Face storage reader (``HuggingFaceStorageReader``), not a hand-written loader: DCP already maps every placement this runtime produces -- ``Shard``,
FSDP2's shards, FSDP x TP's strided shards, uneven shards, pipeline stages holding a subset of
the names -- to file offsets, exactly as it does when a training checkpoint is resharded, and the
copy into each local shard casts the file's dtype (bf16, fp16) to the model's. Both the one-file
(``model.safetensors``) and the sharded (``model.safetensors.index.json`` + parts) forms work:
the reader takes every ``*.safetensors`` file's header. Only how a request's bytes are read is
ours (:mod:`autoplan.plan.safetensors_slices`: ``pread`` of the slice's contiguous runs instead of
a memory map, so a rank's resident memory holds its slices, not the pages of whole tensors).
DCP assumes a rank's shard is one block of the global tensor; a packed projection's shard
(``ColwiseParallel(packed=k)``: a slice of each fused projection) is not, so those tensors are
read whole one at a time and sliced here. Tensors transformers assembles from several file
tensors (an MoE's experts, stored one per expert) are laid out from its converter and read piece
by piece, each rank the sub-boxes it holds (:mod:`autoplan.plan.hf_merged`).

Before any weight is touched every rank reads the headers alone (no tensor data) and checks them
against the *whole* model's persistent tensors, so every rank reaches the same verdict: a
missing tensor, another shape, a tensor the model does not have, an unreadable or truncated
file, an expert missing from an assembled tensor or of another shape --
:class:`~autoplan.errors.PretrainedWeightsError` naming the first tensor at fault (model order)
with both shapes, or the file. Tied weights are stored once, under their owner's name
(``save_pretrained`` writes the embedding, not the tied head); a pipeline stage that holds the
tied head alone reads it under the embedding's name. Non-persistent buffers (RoPE tables) are
not in the files: they get the model's own init.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from autoplan.errors import PretrainedWeightsError
from autoplan.plan.held import held_module
from autoplan.plan.hf_merged import Assembled, assemble, read_assembled
from autoplan.plan.safetensors_slices import SafetensorsFile, SlicedHFReader
from autoplan.plan.weights import ModelInit, held_tensors_on_meta
from hyper_parallel.core.dtensor.blocks import holds_one_block
from hyper_parallel.core.materialize import local_slice, materialize, named_tensors

log = logging.getLogger(__name__)
INDEX = "model.safetensors.index.json"


def has_weights(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding safetensors weights."""
    path = Path(path)
    return path.is_dir() and (any(path.glob("*.safetensors")) or (path / INDEX).is_file())


def read_headers(path: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype, str]]:
    """Every tensor of the safetensors files in ``path``: name -> (shape, dtype, file), read from
    the headers alone. Unreadable, truncated or missing files raise PretrainedWeightsError."""
    path = Path(path)
    if not path.is_dir():
        raise PretrainedWeightsError(f"pretrained weights {str(path)!r}: not a directory; give a directory written "
                                     "by save_pretrained (config.json + model.safetensors)", file=str(path))
    files = sorted(path.glob("*.safetensors"))
    weight_map: dict[str, str] = {}
    if (path / INDEX).is_file():
        try:
            weight_map = dict(json.loads((path / INDEX).read_text())["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise PretrainedWeightsError(f"pretrained weights {path}: {INDEX} is unreadable ({e})", file=INDEX) from None
        listed = sorted(set(weight_map.values()) - {f.name for f in files})
        if listed:
            raise PretrainedWeightsError(f"pretrained weights {path}: {INDEX} lists {listed[0]!r}, which is missing "
                                         f"({len(listed)} missing files)", file=listed[0])
    if not files:
        raise PretrainedWeightsError(f"pretrained weights {path}: no *.safetensors file", file=str(path))
    out: dict[str, tuple[tuple[int, ...], torch.dtype, str]] = {}
    for f in files:
        try:
            with SafetensorsFile(str(f)) as h:
                tensors = h.tensors()
        except (OSError, ValueError, KeyError, TypeError) as e:   # a bad or truncated header
            raise PretrainedWeightsError(f"pretrained weights {path}: {f.name} is unreadable or truncated "
                                         f"({type(e).__name__}: {e})", file=f.name) from None
        for key, (shape, dtype) in tensors.items():
            if key in out:
                raise PretrainedWeightsError(f"pretrained weights {path}: {key!r} is in both {out[key][2]} and "
                                             f"{f.name}", name=key, file=f.name)
            out[key] = (shape, dtype, f.name)
    for key, file in weight_map.items():
        if key in out and out[key][2] != file:
            raise PretrainedWeightsError(f"pretrained weights {path}: {INDEX} puts {key!r} in {file}, it is in "
                                         f"{out[key][2]}", name=key, file=file)
        if key not in out:
            raise PretrainedWeightsError(f"pretrained weights {path}: {INDEX} lists {key!r} in {file}, which does "
                                         "not hold it", name=key, file=file)
    return out


def check_against(facts: ModelInit, found: dict, path) -> None:
    """Raise PretrainedWeightsError for the first persistent tensor of the model (model order)
    that the files lack or hold with another shape, or the first file tensor the model lacks."""
    for name, shape in facts.state_shapes.items():
        if facts.is_alias(name):
            continue
        if name not in found:
            raise PretrainedWeightsError(
                f"pretrained weights {path}: tensor {name!r} of the model, shape {shape}, is not in the files "
                f"({len(found)} tensors there, e.g. {sorted(found)[:3]}); is it a checkpoint of another model "
                "or of another layout of this one?", name=name, expected=shape)
        if tuple(found[name][0]) != shape:
            raise PretrainedWeightsError(
                f"pretrained weights {path}: tensor {name!r} has shape {found[name][0]} in {found[name][2]}, "
                f"{shape} in the model", name=name, expected=shape, found=found[name][0], file=found[name][2])
    extra = [k for k in found if k not in facts.state_shapes]
    if extra:
        raise PretrainedWeightsError(
            f"pretrained weights {path}: tensor {extra[0]!r} (shape {found[extra[0]][0]}, in {found[extra[0]][2]}) "
            f"is not a tensor of the model ({len(extra)} such); is it a checkpoint of another model?",
            name=extra[0], found=found[extra[0]][0], file=found[extra[0]][2])


def _read_whole_then_slice(targets: dict[str, DTensor], found: dict, path: Path) -> None:
    """Tensors whose shards are not one block (packed projections): each is read whole, one at a
    time (the transient is one tensor), and this rank's strided slice is cut from it locally."""
    with torch.no_grad():
        for key, t in targets.items():
            shape, _, file = found[key]
            with SafetensorsFile(str(path / file)) as f:
                full = f.read(key, [0] * len(shape), list(shape))
            t.to_local().copy_(local_slice(full.to(t.dtype), t))
            del full


def by_model_names(facts: ModelInit, stored: dict, path) -> tuple[dict, dict, dict[str, Assembled]]:
    """The headers by the model's names: ``found`` (name -> (shape, dtype, file)), ``file_key`` (name
    -> file key) for tensors stored whole, and the tensors transformers assembles from several file
    tensors, laid out (hf_merged.assemble; found gets their assembled shape for check_against)."""
    found, file_key, slots = {}, {}, {}
    for key, value in stored.items():
        name, slot = facts.model_name(key)
        if slot is None:
            found[name], file_key[name] = value, key
        else:
            slots.setdefault(name, []).append((key, slot))
    merged = {}
    for name, keys in slots.items():
        if name in file_key:
            raise PretrainedWeightsError(f"pretrained weights {path}: the model's {name!r} is stored whole (as "
                                         f"{file_key[name]!r}) and in pieces (e.g. {keys[0][0]!r})", name=name)
        merged[name] = a = assemble(name, keys, stored, facts.state_shapes.get(name), facts.model_name)
        found[name] = (a.shape, stored[a.first_key][1], stored[a.first_key][2])
    return found, file_key, merged


def _read_pieces(pieces: list, stored: dict, path: Path, device, collective: bool) -> None:
    """Assembled tensors: each rank reads the sub-boxes of the file tensors its shard holds. A
    failed read fails every rank (one flag all-reduced), as DCP's reads do, so none waits in the
    first training collective for a rank that has left (``collective``: the checkpoint has assembled
    tensors -- a header fact, the same on every rank -- even where this rank holds none)."""
    files: dict[str, SafetensorsFile] = {}
    done, error = 0, None
    try:
        for f in sorted({stored[p.key][2] for _, a in pieces for p in a.pieces}):
            files[f] = SafetensorsFile(str(path / f))
        file_of = {k: v[2] for k, v in stored.items()}
        done = sum(read_assembled(t, a, files, file_of) for t, a in pieces)
    except (OSError, ValueError, RuntimeError) as e:
        error = e
    finally:
        for f in files.values():
            f.close()
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    if collective and dist.is_initialized():
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        why = f"{type(error).__name__}: {str(error)[:500]}" if error is not None else "on another rank"
        raise PretrainedWeightsError(f"pretrained weights {path}: reading the experts' pieces failed ({why})") from None
    if pieces:
        log.info("read %d assembled tensors from their pieces (%d bytes on this rank)", len(pieces), done)


def load_pretrained(runner, path: str | Path, *, seed: int = 0) -> None:
    """Load the safetensors weights in ``path`` into what this rank holds (collective: every rank
    calls it). The model may be on meta (the large-model path) or real; its non-persistent
    buffers get the model's own init (``seed`` only matters for tensors no file holds: none
    after the check, but buffers a model draws at random)."""
    facts: ModelInit | None = getattr(runner, "model_init", None)
    if facts is None:
        raise PretrainedWeightsError("load_pretrained: this runner was not made by plan.apply")
    stored = read_headers(path)
    found, file_key, merged = by_model_names(facts, stored, path)
    check_against(facts, found, path)
    root = held_module(runner)
    held = named_tensors(root)
    loaded = [n for n in held if n in facts.state_shapes]
    materialize(root, facts.sources, facts.init_fn, device=runner.device, seed=seed, skip=set(loaded))
    held = named_tensors(root)   # the same objects, now real
    state: dict[str, torch.Tensor] = {}
    copies: list[tuple[torch.Tensor, str]] = []
    strided: dict[str, torch.Tensor] = {}   # DCP would read a packed projection's shard at the wrong rows
    pieces: list[tuple[torch.Tensor, Assembled]] = []   # read box by box (hf_merged), not through DCP
    for name in loaded:
        if facts.file_name(name) in merged:
            pieces.append((held[name], merged[facts.file_name(name)]))
            continue
        key, t = file_key[facts.file_name(name)], held[name]
        if isinstance(t, DTensor) and not holds_one_block(t.placements):
            strided.setdefault(key, t)
        elif key not in state:
            state[key] = t.detach()
        elif state[key] is not t and state[key].data_ptr() != t.data_ptr():
            copies.append((t, key))
    try:
        dcp.load(state, storage_reader=SlicedHFReader(str(path)))
    except BaseException as e:   # CheckpointException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failures = getattr(e, "failures", None) or {}   # DCP's CheckpointException: rank -> exception
        first = next(iter(failures.values()), e)
        first = first[0] if isinstance(first, tuple) else first   # (exception, frames)
        raise PretrainedWeightsError(f"pretrained weights {path}: reading the tensors failed on "
                                     f"{'ranks ' + str(sorted(failures)) if failures else 'this rank'} "
                                     f"({type(first).__name__}: {str(first).strip()[:500]})") from None
    _read_whole_then_slice(strided, stored, Path(path))
    _read_pieces(pieces, stored, Path(path), runner.device, collective=bool(merged))
    with torch.no_grad():
        for t, key in copies:   # a second holder of a tied tensor (separate objects on this rank)
            src = state[key]
            if isinstance(t, DTensor) and isinstance(src, DTensor) and t.placements != src.placements:
                src = src.redistribute(t.device_mesh, t.placements)
            t.copy_(src)
    left = held_tensors_on_meta(runner)
    if left:
        raise PretrainedWeightsError(f"load_pretrained: {len(left)} tensors are still on meta, e.g. {left[:3]}")
    log.info("loaded pretrained weights from %s (%d tensors on this rank, %d assembled from pieces)", path,
             len(state) + len(strided), len(pieces))
