"""Deterministic balanced routing: every expert receives the same number of token copies.

Why: the sizes of expert parallel's all-to-alls depend on the router's choices, so a dry run (on
a fake process group, where no data moves) and a prediction of traffic cannot know them. Inside
``balanced_routing()`` every ``ExpertParallel`` module replaces the router's top-k *choice* by a
fixed assignment -- copy ``i`` of token ``t`` goes to expert ``(t * top_k + i) % E`` -- and keeps
the router's weights, so gradients still reach the router. With ``T * top_k`` divisible by
``E`` each expert gets ``T * top_k / E`` copies from every rank, each rank sends and receives
``T * top_k / ep`` rows to and from every peer, and the received token counts are known without
reading the count exchange (which is still issued, so the dry run sees a real step's traffic).

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

    The k experts of a token are distinct (k <= E) and every expert receives exactly
    ``num_tokens * top_k / E`` copies; both conditions are checked.
    """
    if top_k > num_experts:
        raise DivisibilityError(f"balanced_assignment: top_k = {top_k} exceeds num_experts = {num_experts} "
                                f"(valid: top_k <= num_experts)")
    if (num_tokens * top_k) % num_experts:
        raise DivisibilityError(
            f"balanced_assignment: tokens x top_k = {num_tokens} x {top_k} is not divisible by num_experts = "
            f"{num_experts}; balanced routing needs every expert to receive the same number of tokens")
    copies = torch.arange(num_tokens * top_k, device=device)
    return (copies % num_experts).view(num_tokens, top_k)
