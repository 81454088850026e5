"""The load-balanced sequence layout of context parallelism, and the functions that shard a batch
into it and gather outputs back.

Why two chunks per rank: under a causal mask, token t attends to t + 1 keys, so cutting the
sequence into cp contiguous pieces gives the last rank ~2x the average attention work and the
first rank almost none. Cutting it into 2·cp chunks and giving rank r chunks r and 2·cp-1-r (a
head and a tail) gives every rank the same number of (query, key) pairs -- the layout of Megatron
and torchtitan ("zigzag" / head-tail load balancing). Every function here uses that one layout:

    chunks of size c = S / (2·cp);  rank r holds [r·c, (r+1)·c) ++ [(2cp-1-r)·c, (2cp-r)·c)

so the local sequence of every rank has S / cp tokens whose *global* positions are
``local_positions(S, cp, r)``: RoPE and the causal mask must use those, never 0..S/cp-1.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.errors import DivisibilityError, LayoutError


def check_sequence(seq_len: int, cp: int, where: str) -> None:
    """``seq_len`` (global) must split into 2·cp equal chunks."""
    if not isinstance(seq_len, int) or seq_len <= 0 or seq_len % (2 * cp):
        raise DivisibilityError(
            f"{where}: sequence length {seq_len} is not divisible by 2·cp = {2 * cp} (the load-balanced layout "
            f"cuts it into 2·cp equal chunks); pad or cut the sequence to a multiple of {2 * cp}")


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp) rank ``rank`` holds: its head chunk and its tail chunk."""
    if not 0 <= rank < cp:
        raise LayoutError(f"chunk_ids: rank {rank} is not in [0, cp={cp})")
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions (int64, length seq_len / cp) of the tokens rank ``rank`` holds."""
    check_sequence(seq_len, cp, "local_positions")
    c = seq_len // (2 * cp)
    head, tail = chunk_ids(cp, rank)
    return torch.cat([torch.arange(head * c, (head + 1) * c, device=device),
                      torch.arange(tail * c, (tail + 1) * c, device=device)])


def positions_of_local(local_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of a rank's local sequence of ``local_len`` tokens (global length local_len·cp)."""
    if local_len % 2:
        raise DivisibilityError(
            f"context parallel: the local sequence has {local_len} tokens, not an even number; a rank holds two "
            f"equal chunks (global length must be divisible by 2·cp = {2 * cp}); shard the batch with shard_batch")
    return local_positions(local_len * cp, cp, rank, device=device)


def local_spans(local_len: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """The global [start, stop) ranges of a rank's local sequence of ``local_len`` tokens, in local
    order: its head chunk, then its tail chunk (what the attention kernels mask by)."""
    if local_len % 2:
        positions_of_local(local_len, cp, rank)   # raises the DivisibilityError
    c = local_len // 2
    return [(i * c, (i + 1) * c) for i in chunk_ids(cp, rank)]


def shard_sequence(x: torch.Tensor, cp: int, rank: int, seq_dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of the whole-sequence tensor ``x``: its head and tail chunks along ``seq_dim``."""
    seq_dim = seq_dim % x.ndim
    check_sequence(x.shape[seq_dim], cp, f"shard_sequence (dim {seq_dim} of shape {tuple(x.shape)})")
    chunks = x.chunk(2 * cp, dim=seq_dim)
    head, tail = chunk_ids(cp, rank)
    return torch.cat([chunks[head], chunks[tail]], dim=seq_dim)


def _cp_of(mesh: DeviceMesh) -> tuple[int, int]:
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise LayoutError(f"context parallel: expected the 1-D cp mesh (e.g. mesh['cp']), got {mesh!r}")
    return mesh.size(), mesh.get_local_rank()


def shard_batch(mesh: DeviceMesh, *tensors: torch.Tensor, seq_dim: int = 1):
    """Shard whole-sequence tensors (tokens, targets, ...) for this rank of the 1-D cp ``mesh``.

    Returns ``(*local tensors, position_ids)``: ``position_ids`` are the global positions of the
    local tokens, shape (1, S/cp) -- pass them to an HF model as ``position_ids`` (the
    ContextParallel style fills them in when they are omitted).
    """
    if not tensors:
        raise LayoutError("shard_batch: give at least one tensor (tokens)")
    cp, rank = _cp_of(mesh)
    lengths = {t.shape[seq_dim] for t in tensors}
    if len(lengths) != 1:
        raise LayoutError(f"shard_batch: tensors disagree on the sequence length along dim {seq_dim}: {sorted(lengths)}")
    seq = lengths.pop()
    local = tuple(shard_sequence(t, cp, rank, seq_dim) for t in tensors)
    return (*local, local_positions(seq, cp, rank, device=tensors[0].device).unsqueeze(0))


def unshard_sequence(local: torch.Tensor, mesh: DeviceMesh, seq_dim: int = 1) -> torch.Tensor:
    """The whole-sequence tensor from every cp rank's ``local`` part (an all-gather over cp, then the
    chunks put back in order). Differentiable: its backward reduce-scatters the whole-sequence gradient,
    so each rank's chunks receive the sum over cp ranks of what flowed into them."""
    cp, _ = _cp_of(mesh)
    seq_dim = seq_dim % local.ndim
    if cp == 1:
        return local
    gathered = all_gather_single_autograd(local.contiguous(), gather_dim=seq_dim, group=mesh.get_group())
    pieces = gathered.chunk(2 * cp, dim=seq_dim)  # rank r's head at 2r, its tail at 2r+1
    return torch.cat([pieces[i] for i in global_order(cp)], dim=seq_dim)


def global_order(cp: int) -> list[int]:
    """Chunk indices of a gathered sequence (rank 0's head, rank 0's tail, rank 1's head, ...) in
    global order: ``gathered.chunk(2·cp)[global_order(cp)[i]]`` is global chunk i."""
    order = [0] * (2 * cp)
    for r in range(cp):
        head, tail = chunk_ids(cp, r)
        order[head], order[tail] = 2 * r, 2 * r + 1
    return order


def group_rank_size(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, int, int]:
    """(process group, rank in it, size) of the 1-D cp mesh."""
    cp, rank = _cp_of(mesh)
    return mesh.get_group(), rank, cp
