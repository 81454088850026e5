"""Strategies for a state-space (Mamba) mixer: replicated, or split on its inner channels.

``MambaMixerParallel`` (hyper_parallel) cuts every per-channel piece of a Mamba-1 mixer over tp --
in_proj column-wise, the depthwise convolution, dt_proj, A_log and D on their channels, out_proj
row-wise -- and all-reduces x_proj's partial (dt, B, C) in forward and their partial gradient in
backward. Per layer that is Megatron's f/g pair on the stream plus one all-reduce each way of
x_proj's output. A Mamba-2 mixer (Falcon-H1's) is split on its heads by the same style: every
per-head piece and out_proj sharded, in_proj's and conv1d's packed weights kept whole (each rank
computes its rows) with their gradients all-reduced in backward. Offered on a replicated stream
only: on a sequence-sharded one the mixer's scan and convolution need the whole sequence (the
planner keeps that stream off it). Whether the mixer's code is a layout the style splits (heads
and groups dividing tp for Mamba-2) is checked by the probe.
"""
from __future__ import annotations

from hyper_parallel.core.collective import Collective
from hyper_parallel.core.tensor_parallel.mamba_styles import MambaMixerParallel

from autoplan.search.strategies import Strategy, _ar_pair
from autoplan.search.structure import BlockGroupInfo, MambaUnit


def mamba_strategies(m: MambaUnit, blk: BlockGroupInfo, t: int, layout: str) -> list[Strategy]:
    """Replicated, or its channels split over tp (replicated stream only)."""
    if layout != "R":
        return []
    out = [Strategy("replicate", "R", {}, [], reason="state-space mixer replicated")]
    if t == 1:
        return out
    if not m.channels or m.channels % t:
        out[0].extra["tp_excluded"] = f"mixer channels {m.channels} not divisible by tp={t}"
        return out
    if m.whole_param_bytes:   # Mamba-2: in_proj's and conv1d's weight gradients all-reduced, the rest sharded
        total, whole = max(m.work.param_bytes, 1), sum(m.whole_param_bytes)
        comm = _ar_pair(blk.hidden_bytes) + [Collective("all_reduce", "backward", b, weight_grad=True)
                                             for b in m.whole_param_bytes]
        out.append(Strategy("channels_sharded", "R", {m.rel: MambaMixerParallel()}, comm, compute_shard=t,
                            param_shard=total / (whole + (total - whole) / t),
                            activation_shard=t,
                            reason="Mamba-2 mixer split on its heads: z/x/B/C/dt rows of in_proj and the conv "
                                   "channels computed per rank from whole weights (their gradients all-reduced), "
                                   "A_log, D, dt_bias and the norm per head, out_proj row-wise"))
        return out
    # x_proj's output all-reduced in forward; the partial gradients in backward, one all-reduce per
    # module they are last whole after (Jamba's three norms), else one at x_proj's output
    grads = m.after_bytes if m.after else [m.xproj_bytes]
    comm = _ar_pair(blk.hidden_bytes) + [Collective("all_reduce", "forward", m.xproj_bytes)] + \
        [Collective("all_reduce", "backward", b) for b in grads]
    out.append(Strategy("channels_sharded", "R", {m.rel: MambaMixerParallel(replicated_after=m.after or None)}, comm,
                        compute_shard=t, param_shard=t, activation_shard=t,
                        reason=f"Mamba mixer split on its {m.channels} inner channels: in_proj column-wise, conv1d, "
                               f"dt_proj, A_log and D per channel, out_proj row-wise; x_proj's (dt, B, C) all-reduced"
                               + (f", last whole after {', '.join(m.after)}" if m.after else "")))
    return out
