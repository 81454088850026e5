"""Deterministic balanced routing: every expert receives the same number of token copies.

Why: the sizes of expert parallel's all-to-alls depend on the router's choices, so a dry run (on
a fake process group, where no data moves) and a prediction of traffic cannot know them. Inside
``balanced_routing()`` every ``ExpertParallel`` module replaces the router's top-k *choice* by a
fixed assignment -- copy ``i`` of token ``t`` goes to expert ``(t * top_k + i) % E`` -- and keeps
the router's weights, so gradients still reach the router. Every expert gets ``T * top_k // E``
copies from every rank (one more for the first ``T * top_k % E`` experts), so the rows each rank
sends to and receives from every peer are known without reading the count exchange (which is
still issued, so the dry run sees a real step's traffic).

Use it for dry runs, traffic verification and benchmarks, never for training (the model's
routing is ignored).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

from hyper_parallel.errors import DivisibilityError

_STATE = threading.local()


@contextlib.contextmanager
def balanced_routing() -> Iterator[None]:
    """Within the block, ExpertParallel modules route by :func:`balanced_assignment`."""
    previous = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = previous


def balanced_routing_active() -> bool:
    return getattr(_STATE, "on", False)


def balanced_assignment(num_tokens: int, top_k: int, num_experts: int,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """[num_tokens, top_k] expert ids: copy i of token t goes to expert (t * top_k + i) % E.

    The k experts of a token are distinct (k <= E, checked); expert e receives
    ``balanced_counts(num_tokens * top_k, E)[e]`` copies -- the same number for every expert when
    E divides the copies, one more for the first ``copies % E`` experts otherwise (any token count
    routes: real routing never divides evenly either).
    """
    if top_k > num_experts:
        raise DivisibilityError(f"balanced_assignment: top_k = {top_k} exceeds num_experts = {num_experts} "
                                f"(valid: top_k <= num_experts)")
    copies = torch.arange(num_tokens * top_k, device=device)
    return (copies % num_experts).view(num_tokens, top_k)


def expert_blocks(num_experts: int, ep: int) -> list[tuple[int, int]]:
    """(first expert, how many) each ep rank owns: contiguous blocks of ``ceil(E / ep)`` experts,
    the last ones shorter or empty when ep does not divide E -- exactly how a DTensor
    ``Shard(0)`` splits the stacked expert weights (torch.chunk), so the weights and the routing
    agree on who owns which expert (6 experts over ep=4: 2, 2, 2, 0)."""
    size = -(-num_experts // ep)
    return [(min(r * size, num_experts), max(0, min(size, num_experts - r * size))) for r in range(ep)]


def balanced_counts(copies: int, num_experts: int) -> list[int]:
    """Copies each expert receives under :func:`balanced_assignment` (``copies = tokens x top_k``)."""
    q, rem = divmod(copies, num_experts)
    return [q + (e < rem) for e in range(num_experts)]


def balanced_order(copies: int, num_experts: int, device) -> torch.Tensor:
    """The copies sorted (stably) by expert under :func:`balanced_assignment`, from sizes alone
    (no tensor value is read, so it runs on meta and fake tensors): expert e's copies are
    e, e + E, e + 2E, ...; the first ``copies % E`` experts have one more."""
    q, rem = divmod(copies, num_experts)
    full = torch.arange((q + 1) * num_experts, device=device).view(q + 1, num_experts)
    return torch.cat([full[:, :rem].t().reshape(-1), full[:q, rem:].t().reshape(-1)])
