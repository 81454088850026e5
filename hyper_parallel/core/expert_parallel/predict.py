"""The collectives ExpertParallel issues per MoE layer per training step, under balanced routing.

Per rank, with ``T`` tokens, top-k ``k``, hidden ``H``, ``E`` experts, balanced routing (every
expert receives ``T*k // E`` copies from every rank, the first ``T*k % E`` experts one more; any
token count and any ep route), for rank 0 of the ep group (its experts ``expert_blocks(E, ep)[0]``
receive ``R = ep x`` their copies -- the most of any rank, ``T*k`` when E divides them evenly):

forward
- all_to_all over ep: the per-expert counts, ``ceil(E/ep) * ep`` int64 (8 bytes each; padded to
  equal blocks per rank);
- all_to_all over ep: dispatch, ``T*k*H*b`` bytes (the rows this rank sends);
- all_to_all over ep: combine, ``R*H*b`` bytes (the rows it sends back);
- with tp: all_reduce over tp of the partial expert outputs, ``R*H*b``.
backward
- two all_to_all over ep (the reverse of dispatch and combine), ``R*H*b`` and ``T*k*H*b``;
- with tp: all_reduce over tp of the expert input gradient, ``R*H*b``.

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
from hyper_parallel.core.expert_parallel.routing import balanced_counts, expert_blocks
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
    weight_bytes = dtype_bytes if weight_bytes is None else weight_bytes
    split = style.split_tokens and ep > 1
    if split and tokens % ep:
        raise DivisibilityError(f"expert_parallel_collectives: split_tokens needs tokens = {tokens} divisible by "
                                f"ep = {ep}")
    routed = tokens // ep if split else tokens
    if tp > 1 and (style.tp_dim is None or ffn % tp):
        raise DivisibilityError(f"expert_parallel_collectives: tp = {tp} needs the style's tp_dim (got "
                                f"{style.tp_dim!r}) and ffn = {ffn} divisible by tp")
    copies = routed * top_k
    first, n = expert_blocks(experts, ep)[0]
    received = ep * sum(balanced_counts(copies, experts)[first:first + n])   # rank 0's experts' rows
    sent, kept = copies * hidden * dtype_bytes, received * hidden * dtype_bytes
    out: list[Collective] = []
    if split:
        out += [Collective("all_gather", "forward", tokens * hidden * dtype_bytes, 1, style.ep_dim),
                Collective("all_gather", "backward", tokens * hidden * dtype_bytes, 1, style.ep_dim),
                Collective("all_gather", "backward", tokens * top_k * weight_bytes, 1, style.ep_dim)]
    if ep > 1:
        size = -(-experts // ep)
        out.append(Collective("all_to_all", "forward", size * ep * COUNT_BYTES, 1, style.ep_dim))
        for phase in ("forward", "backward"):   # dispatch sends the copies, combine the received rows back
            out += [Collective("all_to_all", phase, sent, 2, style.ep_dim)] if sent == kept else \
                [Collective("all_to_all", phase, sent, 1, style.ep_dim),
                 Collective("all_to_all", phase, kept, 1, style.ep_dim)]
    if tp > 1:   # the partial outputs of the rows this rank's experts computed, and their input gradient
        out += [Collective("all_reduce", "forward", kept, 1, style.tp_dim),
                Collective("all_reduce", "backward", kept, 1, style.tp_dim)]
    return out
