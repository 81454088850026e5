"""Whether a rank's shard is one block of the global tensor -- what torch's distributed checkpoint
assumes -- and how to make it one.

DCP maps a DTensor to file offsets with ``compute_local_shape_and_global_offset``: one offset
and one shape per rank. That holds for plain shards and for FSDP x TP on one dim
(``_StridedShard(d)`` beside ``Shard(d)``), but not for a packed projection's strided shard
(``ColwiseParallel(packed=k)``: each rank a slice of each of k fused projections): its chunks
overlap or land at the wrong rows (measured on torch 2.13: DCP's save refuses "overlapping
chunks"). Such tensors are written after :func:`as_plain_shards` and read whole, then sliced.
"""
from __future__ import annotations

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def _strided_beside_its_shard(p, placements) -> bool:
    return isinstance(p, _StridedShard) and any(type(q) is Shard and q.dim == p.dim for q in placements)


def holds_one_block(placements) -> bool:
    """Whether a rank's local tensor under ``placements`` is one contiguous block of the global
    tensor at the offset DTensor computes (see module doc)."""
    return all(type(p) in (Shard, Replicate) or _strided_beside_its_shard(p, placements) for p in placements)


def as_plain_shards(t: DTensor) -> DTensor:
    """``t`` with each strided shard replaced by a plain one on the same dim. Through Replicate:
    a redistribute straight from ``_StridedShard(d)`` to ``Shard(d)`` is taken for a no-op (the
    two compare equal)."""
    via = [Replicate() if isinstance(p, _StridedShard) else p for p in t.placements]
    plain = [Shard(p.dim) if isinstance(p, _StridedShard) else p for p in t.placements]
    return t.redistribute(t.device_mesh, via).redistribute(t.device_mesh, plain)


def dcp_mappable(state: dict) -> tuple[dict, list[tuple[str, DTensor]]]:
    """``state`` with every strided entry replaced by a plain-shard copy, for DCP to save or to load
    into; the replaced ``(key, original)`` pairs come back for :func:`copy_back` after a load."""
    out, replaced = {}, []
    for key, value in state.items():
        if isinstance(value, DTensor) and not holds_one_block(value.placements):
            out[key] = as_plain_shards(value)
            replaced.append((key, value))
        else:
            out[key] = value
    return out, replaced


def copy_back(loaded: dict, replaced: list[tuple[str, DTensor]]) -> None:
    """After DCP loaded into the plain-shard copies, put each value back into its strided original."""
    for key, original in replaced:
        plain = loaded[key]
        via = [Replicate() if isinstance(p, _StridedShard) else p for p in original.placements]
        strided = plain.redistribute(plain.device_mesh, via).redistribute(plain.device_mesh, original.placements)
        original.to_local().copy_(strided.to_local())
