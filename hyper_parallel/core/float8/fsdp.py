"""FSDP2 with float8 all-gather: every tensorwise weight's scale from the whole mesh, before the gather.

torchao's float8 weights under FSDP2 (``WeightWithDynamicFloat8CastTensor``) cast their local
shard to float8 before FSDP gathers it. Left to itself the cast takes its amax over the FSDP
group only: right for FSDP alone, but with tensor parallel beside it each tp rank's shard would get
its own scale (and an HSDP mesh has no single group to reduce over). torchao's
``precompute_float8_dynamic_scale_for_fsdp`` computes every weight's amax over the weight's whole
DTensor mesh in one all-reduce and stores the scale the gather then uses -- the scale one device
would compute. torchtitan calls it after each optimizer step; here a forward pre-hook on each FSDP
root calls it before the root's own gathers, so it holds after any change of the weights (an
optimizer step, a checkpoint load, ``materialize``) without the caller's loop knowing about it.
Each micro-batch's forward pays it again (one all-reduce of one float per weight).

Those weights -- and the optimizer state made from them (``zeros_like`` keeps the subclass) --
are torchao wrapper tensors around the high-precision values. Torch DCP writes a tensor it does
not know by pickling the object (a checkpoint that imports torchao when read, which the guarded
loads rightly refuse) and its Hugging Face writer cannot reach a wrapper's storage at all, so
whatever writes or reads state takes :func:`high_precision_state` of it: the same storage as
plain tensors, under the same names -- checkpoints and exports hold the master weights as a run
without float8 would.
"""
from __future__ import annotations

import sys

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from hyper_parallel.core.float8.quiet import quiet_torchao_import


def float8_gathered(module: nn.Module) -> int:
    """How many weights of ``module`` FSDP gathers in float8."""
    quiet_torchao_import()
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor   # torchao on first use

    return sum(isinstance(p._local_tensor if isinstance(p, DTensor) else p, WeightWithDynamicFloat8CastTensor)
               for p in module.parameters())


def _precompute(module: nn.Module, *_):
    """torchao's precomputation, then each scale rounded down to a power of two when its Linear's
    recipe says so (torchao's precomputation does not round; the Linear's own cast does)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp   # loaded by float8_gathered
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_utils import _round_scale_down_to_power_of_2

    precompute_float8_dynamic_scale_for_fsdp(module)
    for m in module.modules():
        weight = getattr(m, "weight", None)
        local = weight._local_tensor if isinstance(weight, DTensor) else None
        if isinstance(m, Float8Linear) and m.config.round_scales_to_power_of_2 \
                and getattr(local, "_precomputed_scale", None) is not None:
            local._precomputed_scale = _round_scale_down_to_power_of_2(local._precomputed_scale)


def scale_before_gather(root: nn.Module) -> bool:
    """Register the scale computation on ``root``, before ``fully_shard`` wraps it: FSDP then puts
    its own pre-forward hook in front (it prepends), which gathers the root unit's parameters only,
    and the hook here runs before any block's gather -- so float8-gathered weights must sit in
    blocks, their own FSDP units. Returns False (nothing registered) when it holds no
    float8-gathered weights."""
    if not float8_gathered(root):
        return False
    root.register_forward_pre_hook(_precompute, prepend=True)
    return True


def _wrapper_type():
    """torchao's float8 weight wrapper, or None when torchao's FSDP support was never imported (then
    no tensor of the process can be one; a checkpoint of a run without float8 imports nothing)."""
    module = sys.modules.get("torchao.float8.fsdp_utils")
    return getattr(module, "WeightWithDynamicFloat8CastTensor", None)


def high_precision(t, wrapper=None):
    """``t``, or where it (or its DTensor's local shard) is a float8-gathered weight, the same values
    as a plain tensor over the same storage (writes through it land in the weight)."""
    wrapper = wrapper or _wrapper_type()
    if wrapper is None or not isinstance(t, torch.Tensor):
        return t
    if isinstance(t, DTensor):
        local = t._local_tensor
        if not isinstance(local, wrapper):
            return t
        return DTensor.from_local(local._tensor.detach(), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t._tensor.detach() if isinstance(t, wrapper) else t


def high_precision_state(state: dict) -> dict:
    """A state dict with every float8-gathered tensor as :func:`high_precision` gives it (the dict
    itself when there is none)."""
    wrapper = _wrapper_type()
    if wrapper is None:
        return state
    return {k: high_precision(v, wrapper) for k, v in state.items()}
