"""Strategies for a state-space (Mamba) mixer: replicated, or split on its inner channels.

``MambaMixerParallel`` (hyper_parallel) cuts every per-channel piece of a Mamba-1 mixer over tp --
in_proj column-wise, the depthwise convolution, dt_proj, A_log and D on their channels, out_proj
row-wise -- and all-reduces x_proj's partial (dt, B, C) in forward and their partial gradient in
backward. Per layer that is Megatron's f/g pair on the stream plus one all-reduce each way of
x_proj's output. A Mamba-2 mixer (Falcon-H1's) is split on its heads by the same style: every
per-head piece and out_proj sharded, in_proj's and conv1d's packed weights kept whole (each rank
computes its rows) with their gradients all-reduced in backward. On a sequence-sharded stream the
mixer's scan and convolution need the whole sequence: replicated, the mixer is a gathered region
(the sequence gathered at its input, the shard sliced out of its output, as the MoE container);
split, the style gathers the sequence itself and reduce-scatters its partial output (Megatron's
sequence-parallel pair in place of the two all-reduces). Whether the mixer's code is a layout the style splits (heads
and groups dividing tp for Mamba-2) is checked by the probe.
"""
from __future__ import annotations

from hyper_parallel.core.collective import Collective
from hyper_parallel.core.tensor_parallel.mamba_styles import MambaMixerParallel
from hyper_parallel.core.tensor_parallel.sequence_region import GatheredRegion

from autoplan.search.tp.strategies import Strategy, _ag_rs_pair, _ar_pair, _replicated_region_on_s
from autoplan.search.units.mixers import MambaUnit
from autoplan.search.units.structure import BlockGroupInfo


def mamba_strategies(m: MambaUnit, blk: BlockGroupInfo, t: int, layout: str) -> list[Strategy]:
    """Replicated, or its channels split over tp; on a sequence-sharded stream (``layout`` "S")
    both take the whole sequence inside the mixer."""
    h = blk.hidden_bytes
    seq = 1 if layout == "S" else None
    pair = _ag_rs_pair(h) if seq is not None else _ar_pair(h)
    if layout == "S":
        out = [Strategy("replicate", "S", _gathered(m.rel), _replicated_region_on_s(h),
                        reason="state-space mixer replicated on the gathered sequence")]
    else:
        out = [Strategy("replicate", "R", {}, [], reason="state-space mixer replicated")]
    if t == 1:
        return out
    if not m.channels or m.channels % t:
        out[0].extra["tp_excluded"] = f"mixer channels {m.channels} not divisible by tp={t}"
        return out
    if m.whole_param_bytes:   # Mamba-2: in_proj's and conv1d's weight gradients all-reduced, the rest sharded
        total, whole = max(m.work.param_bytes, 1), sum(m.whole_param_bytes)
        comm = pair + [Collective("all_reduce", "backward", b, weight_grad=True) for b in m.whole_param_bytes]
        out.append(Strategy("channels_sharded", layout, {m.rel: MambaMixerParallel(sequence_dim=seq)}, comm,
                            compute_shard=t,
                            param_shard=total / (whole + (total - whole) / t),
                            activation_shard=t,
                            reason="Mamba-2 mixer split on its heads: z/x/B/C/dt rows of in_proj and the conv "
                                   "channels computed per rank from whole weights (their gradients all-reduced), "
                                   "A_log, D, dt_bias and the norm per head, out_proj row-wise"))
        return out
    # x_proj's output all-reduced in forward; the partial gradients in backward, one all-reduce per
    # module they are last whole after (Jamba's three norms), else one at x_proj's output
    grads = m.after_bytes if m.after else [m.xproj_bytes]
    comm = pair + [Collective("all_reduce", "forward", m.xproj_bytes)] + \
        [Collective("all_reduce", "backward", b) for b in grads]
    style = MambaMixerParallel(replicated_after=m.after or None, sequence_dim=seq)
    out.append(Strategy("channels_sharded", layout, {m.rel: style}, comm,
                        compute_shard=t, param_shard=t, activation_shard=t,
                        reason=f"Mamba mixer split on its {m.channels} inner channels: in_proj column-wise, conv1d, "
                               f"dt_proj, A_log and D per channel, out_proj row-wise; x_proj's (dt, B, C) all-reduced"
                               + (f", last whole after {', '.join(m.after)}" if m.after else "")))
    return out


def _gathered(rel: str) -> dict:
    """The mixer taking the sequence-sharded stream in whole and giving its shard back."""
    return {rel: GatheredRegion(sequence_dim=1)}
