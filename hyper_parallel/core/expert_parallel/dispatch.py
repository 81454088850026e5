"""Token dispatch and combine for expert parallelism, and expert tensor parallelism's f/g pair.

A rank holds ``T`` tokens, each routed to ``top_k`` experts out of ``E``; experts are split in
``ep`` contiguous blocks of ``L = ceil(E / ep)`` (rank r of the ep group owns experts
``[r*L, min((r+1)*L, E))``: ``routing.expert_blocks``, the way DTensor shards the weights). Dispatch sorts the ``T * top_k`` token copies by expert (so they are
grouped by destination rank), exchanges the per-expert counts with one all-to-all, then sends
the rows with a second; the receiver regroups them by local expert for the grouped GEMM.
Combine reverses both steps. The row all-to-alls are autograd functions (their backward is the
reverse all-to-all), so gradients flow to the tokens and through them to the router.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from hyper_parallel.core.expert_parallel.routing import balanced_counts, balanced_order, expert_blocks


def _wait(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


@dataclass
class Dispatch:
    """The bookkeeping of one dispatch, kept for its combine."""

    order: torch.Tensor          # copies sorted by expert: index into the flattened [T * top_k]
    token_of_copy: torch.Tensor  # token index of each sorted copy
    send_splits: list[int]       # rows sent to each ep rank
    recv_splits: list[int]       # rows received from each ep rank
    local_counts: list[int]      # rows per local expert after regrouping
    regroup: torch.Tensor        # received rows -> rows grouped by local expert
    ungroup: torch.Tensor        # its inverse


def exchange_counts(per_expert: torch.Tensor, ep: int, group: dist.ProcessGroup) -> torch.Tensor:
    """[ep, ceil(E / ep)]: rows each source rank sends to each of my local experts (zeros past my
    last expert when ep does not divide E: the counts are padded to equal blocks per rank)."""
    size = -(-per_expert.numel() // ep)
    padded = torch.nn.functional.pad(per_expert, (0, size * ep - per_expert.numel()))
    return _wait(funcol.all_to_all_single(padded, None, None, group)).view(ep, size)


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, ep: int,
             group: dist.ProcessGroup, balanced: bool, rank: int) -> tuple[torch.Tensor, Dispatch]:
    """Send every token copy to the rank that owns its expert; rows come back grouped by local expert.

    Any split: the experts are owned in ``expert_blocks`` (uneven when ep does not divide E) and
    the all-to-alls take per-peer row counts, so no rank needs the same number of rows as another."""
    top_k = top_k_index.shape[-1]
    blocks = expert_blocks(num_experts, ep)
    if balanced:
        order, send_splits, recv_splits, local_counts, regroup = _balanced_plan(
            top_k_index.numel(), num_experts, ep, rank, group, hidden.device)
    else:
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=num_experts)
        recv = exchange_counts(per_expert, ep, group)[:, :blocks[rank][1]]
        send_splits = [int(per_expert[a:a + n].sum()) for a, n in blocks]
        recv_splits = recv.sum(1).tolist()
        local_counts = recv.sum(0).tolist()
        # received rows are ordered (source rank, local expert); regroup them by local expert
        expert_of_row = torch.repeat_interleave(torch.arange(recv.shape[1], device=hidden.device).repeat(ep),
                                                recv.reshape(-1).to(hidden.device))
        regroup = torch.argsort(expert_of_row, stable=True)
    token_of_copy = torch.div(order, top_k, rounding_mode="floor")
    rows = hidden[token_of_copy]
    received = _wait(funcol.all_to_all_single_autograd(rows, recv_splits, send_splits, group))
    info = Dispatch(order, token_of_copy, send_splits, recv_splits, local_counts, regroup, torch.argsort(regroup))
    return received[regroup], info


def _balanced_plan(copies: int, num_experts: int, ep: int, rank: int, group: dist.ProcessGroup, device):
    """Dispatch bookkeeping under balanced routing (copy j -> expert j % E), from sizes alone.

    Nothing here reads tensor values, so it runs on meta and fake tensors (verify's dry runs):
    expert e gets ``balanced_counts(copies, E)[e]`` copies from every rank (every rank of the
    group routes the same number of copies); received rows (source rank, local expert, copy)
    regroup by local expert. The count exchange is still issued -- it is part of a real step's
    traffic."""
    counts = balanced_counts(copies, num_experts)
    blocks = expert_blocks(num_experts, ep)
    exchange_counts(torch.tensor(counts, dtype=torch.int64, device=device), ep, group)
    order = balanced_order(copies, num_experts, device)
    first, n = blocks[rank]
    mine = counts[first:first + n]
    received = sum(mine)
    pieces, offset = [], 0
    for c in mine:   # local expert l: its c rows from each source s sit at s * received + offset
        pieces.append((torch.arange(ep, device=device)[:, None] * received + offset
                       + torch.arange(c, device=device)[None, :]).reshape(-1))
        offset += c
    regroup = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)
    send = [sum(counts[a:a + k]) for a, k in blocks]
    return order, send, [received] * ep, [c * ep for c in mine], regroup


def combine(expert_out: torch.Tensor, info: Dispatch, top_k_weights: torch.Tensor, num_tokens: int,
            group: dist.ProcessGroup, out_dtype: torch.dtype) -> torch.Tensor:
    """Send expert outputs back, scale each copy by its routing weight and sum a token's copies.

    The scaling is the module's own (output of the down projection times the weight), done on
    the token's rank after the return trip: the same product of the same values.
    """
    back = _wait(funcol.all_to_all_single_autograd(expert_out[info.ungroup], info.send_splits,
                                                    info.recv_splits, group))
    weights = top_k_weights.reshape(-1)[info.order]
    scaled = back * weights[:, None]
    out = torch.zeros(num_tokens, expert_out.shape[-1], dtype=out_dtype, device=expert_out.device)
    return out.index_add(0, info.token_of_copy, scaled.to(out_dtype))


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient over tp in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _wait(funcol.all_reduce(grad.contiguous(), "sum", ctx.group)), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce of the partial expert outputs over tp, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _wait(funcol.all_reduce(x.contiguous(), "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class SplitTokens(torch.autograd.Function):
    """Tokens replicated over the ep group -> this rank's 1/ep slice of them (``split_tokens``).

    Every rank computes the same loss from the gathered output, so the gradient of the whole
    input is the concatenation of the slices' gradients: an all-gather in backward."""

    @staticmethod
    def forward(ctx, x, rank, ep, group):
        ctx.group = group
        return x.chunk(ep, dim=0)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _wait(funcol.all_gather_tensor(grad.contiguous(), 0, ctx.group)), None, None, None


class GatherTokens(torch.autograd.Function):
    """The slices' outputs gathered back to every rank of the ep group; backward keeps this rank's
    slice of the (identical on every rank) output gradient."""

    @staticmethod
    def forward(ctx, x, rank, ep, group):
        ctx.rank, ctx.ep = rank, ep
        return _wait(funcol.all_gather_tensor(x.contiguous(), 0, group))

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.ep, dim=0)[ctx.rank].contiguous(), None, None, None
