"""The collectives ExpertParallel issues per MoE layer per training step, under balanced routing.

Per rank, with ``T`` tokens, top-k ``k``, hidden ``H``, ``E`` experts, balanced routing (every
rank sends ``T*k/ep`` rows to every peer and receives as many):

forward
- all_to_all over ep: the per-expert counts, ``E`` int64 (8 bytes each);
- all_to_all over ep: dispatch, ``T*k*H*b`` bytes (the rows this rank sends);
- all_to_all over ep: combine, ``T*k*H*b`` bytes (the rows it sends back);
- with tp: all_reduce over tp of the partial expert outputs, ``T*k*H*b``.
backward
- two all_to_all over ep (the reverse of dispatch and combine), ``T*k*H*b`` each;
- with tp: all_reduce over tp of the expert input gradient, ``T*k*H*b``.

With ``split_tokens`` (the ep group holds the same T tokens) each rank dispatches ``T/ep`` of
them (so ``T/ep`` replaces ``T`` above) and adds, over ep: forward one all_gather of the outputs
(``T*H*b``), backward one all_gather of the hidden-state gradient (``T*H*b``) and one of the
routing-weight gradient (``T*k*w``, ``w = weight_bytes``: transformers' routers often keep their
weights in float32).

Bytes are one call's logical bytes (cost_models' convention: for an all-to-all the rank's whole
send buffer, for an all-gather the gathered tensor). With ep == 1 nothing is sent over ep. Bytes
assume the expert weights and the hidden states share one dtype (``dtype_bytes``).
"""
from __future__ import annotations

from hyper_parallel.core.collective import Collective
from hyper_parallel.errors import DivisibilityError, StyleSpecError

COUNT_BYTES = 8  # torch.bincount's int64


def expert_parallel_collectives(style, *, tokens: int, hidden: int, ffn: int, top_k: int, experts: int,
                                dtype_bytes: int, ep: int, tp: int = 1,
                                weight_bytes: int | None = None) -> list[Collective]:
    """``style``: an ExpertParallel (its ep_dim / tp_dim name the mesh dimensions)."""
    for name, value in (("tokens", tokens), ("hidden", hidden), ("ffn", ffn), ("top_k", top_k),
                        ("experts", experts), ("dtype_bytes", dtype_bytes), ("ep", ep), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise StyleSpecError(f"expert_parallel_collectives: {name} must be a positive int, got {value!r}")
    if experts % ep:
        raise DivisibilityError(f"expert_parallel_collectives: experts = {experts} is not divisible by ep = {ep}")
    weight_bytes = dtype_bytes if weight_bytes is None else weight_bytes
    split = style.split_tokens and ep > 1
    if split and tokens % ep:
        raise DivisibilityError(f"expert_parallel_collectives: split_tokens needs tokens = {tokens} divisible by "
                                f"ep = {ep}")
    routed = tokens // ep if split else tokens
    if (routed * top_k) % experts:
        raise DivisibilityError(f"expert_parallel_collectives: tokens x top_k = {routed * top_k} routed per rank is "
                                f"not divisible by experts = {experts}, so routing cannot be balanced")
    if tp > 1 and (style.tp_dim is None or ffn % tp):
        raise DivisibilityError(f"expert_parallel_collectives: tp = {tp} needs the style's tp_dim (got "
                                f"{style.tp_dim!r}) and ffn = {ffn} divisible by tp")
    rows = routed * top_k * hidden * dtype_bytes
    out: list[Collective] = []
    if split:
        out += [Collective("all_gather", "forward", tokens * hidden * dtype_bytes, 1, style.ep_dim),
                Collective("all_gather", "backward", tokens * hidden * dtype_bytes, 1, style.ep_dim),
                Collective("all_gather", "backward", tokens * top_k * weight_bytes, 1, style.ep_dim)]
    if ep > 1:
        out += [Collective("all_to_all", "forward", experts * COUNT_BYTES, 1, style.ep_dim),
                Collective("all_to_all", "forward", rows, 2, style.ep_dim),
                Collective("all_to_all", "backward", rows, 2, style.ep_dim)]
    if tp > 1:
        out += [Collective("all_reduce", "forward", rows, 1, style.tp_dim),
                Collective("all_reduce", "backward", rows, 1, style.tp_dim)]
    return out
