"""ContextParallel: the style that runs a whole causal language model on a sequence shard.

Applied to the model's root on the 1-D cp mesh, it changes three things, all recorded for
rollback and all checked before any of them is made:
- every attention layer computes over the whole cp ring (``CPAttention``): the repo Llama's
  ``Attention.attention_kernel`` hook, or transformers' attention registry (``hf``);
- the root's forward gets the global positions of its load-balanced shard when the caller gives
  none (``positions`` for the repo Llama, ``position_ids`` for transformers), so RoPE is right;
- the input is checked: an even local length (two chunks), no padding mask.
The batch itself is sharded by the caller (``shard_batch``), as in torchtitan: a data loader
that yields shards never materialises the whole sequence on one rank.

``apply_context_parallel(model, mesh, cp_dim="cp", variant=...)`` is the one entry point; it is
``parallelize_module(model, mesh, {"": ContextParallel(variant=...)}, mesh_dim=cp_dim)``.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.core.context_parallel.attention import CPAttention, check_variant
from hyper_parallel.core.context_parallel.hf import (
    HF_ATTENTION_NAME,
    KERNEL_ATTR,
    hf_attention_modules,
    hf_unsupported,
    is_hf_model,
    register_hf_attention,
)
from hyper_parallel.core.context_parallel.layout import positions_of_local
from hyper_parallel.core.tensor_parallel.base import ApplyRecord, ParallelStyle
from hyper_parallel.core.tensor_parallel.parallelize import parallelize_module
from hyper_parallel.errors import LayoutError, MeshError, UnsupportedModuleError

KERNEL_HOOK = "attention_kernel"  # the repo Llama's Attention hook (class attribute, None = SDPA)


def _kernel_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(fqn, m) for fqn, m in module.named_modules() if KERNEL_HOOK in dir(type(m))]


def _position_arg(module: nn.Module) -> str | None:
    params = inspect.signature(module.forward).parameters
    for name in ("position_ids", "positions"):
        if name in params:
            return name
    return None


class ContextParallel(ParallelStyle):
    """Context parallelism for a causal LM root module: ``variant`` "ring" (K/V passed around the cp
    ring, P2P) or "allgather" (K/V gathered once; cheaper for few KV heads)."""

    _args = {"variant": "ring"}

    def __init__(self, *, variant: str = "ring"):
        self.variant = check_variant(variant, "ContextParallel")

    def _targets(self, module: nn.Module, where: str):
        hf = is_hf_model(module)
        layers = hf_attention_modules(module) if hf else _kernel_modules(module)
        if not layers:
            raise UnsupportedModuleError(
                f"{where}: {type(module).__name__} has no attention layer to make context parallel: expected a "
                f"transformers model (attention through AttentionInterface) or modules with an "
                f"'{KERNEL_HOOK}' hook (autoplan.models.llama.Attention); apply it to the model's root")
        return hf, layers

    def check_module(self, module: nn.Module, mesh: DeviceMesh, fqn: str) -> None:
        where = f"ContextParallel on {fqn or '<root>'}"
        if mesh.ndim != 1:
            raise MeshError(f"{where}: needs the 1-D cp mesh, got {mesh.ndim}-D; pass mesh_dim='cp'")
        self.check_model(module, where)

    def check_model(self, module: nn.Module, where: str) -> None:
        """Everything ``check_module`` checks that needs no mesh: a causal model root this style can
        hook (the planner calls it before choosing cp > 1, on a meta model)."""
        hf, layers = self._targets(module, where)
        arg = _position_arg(module)
        expected = "position_ids" if hf else "positions"
        if arg != expected:
            raise UnsupportedModuleError(f"{where}: {type(module).__name__}.forward takes no '{expected}' argument, so "
                                         f"the shard's global positions cannot reach RoPE; apply it to the model's root")
        if hf:
            why = hf_unsupported(module)
            if why:
                raise LayoutError(f"{where}: {why}")
            current = module.config._attn_implementation
            if current == HF_ATTENTION_NAME or any(getattr(m, KERNEL_ATTR, None) is not None for _, m in layers):
                raise LayoutError(f"{where}: the model already runs context parallel attention")
        else:
            busy = [f for f, m in layers if getattr(m, KERNEL_HOOK) is not None]
            if busy:
                raise LayoutError(f"{where}: {busy[0]!r} already has an attention kernel "
                                  f"({getattr(dict(layers)[busy[0]], KERNEL_HOOK)!r})")

    def apply(self, module: nn.Module, mesh: DeviceMesh, record: ApplyRecord, fqn: str = "") -> nn.Module:
        where = f"ContextParallel on {fqn or '<root>'}"
        kernel = CPAttention(mesh, self.variant)
        hf, layers = self._targets(module, where)
        if hf:
            register_hf_attention()
            for _, m in layers:
                record.add_flag(m, KERNEL_ATTR, kernel)
            record.set_attr(module.config, "_attn_implementation", HF_ATTENTION_NAME)
        else:
            for _, m in layers:
                record.set_attr(m, KERNEL_HOOK, kernel)
        arg = _position_arg(module)
        record.add_hook(module.register_forward_pre_hook(_input_hook(arg, kernel, where, hf), with_kwargs=True))
        return module


def _input_hook(arg: str, kernel: CPAttention, where: str, hf: bool):
    def hook(mod, args, kwargs):
        given = [args[0]] if args else [kwargs.get(k) for k in ("input_ids", "tokens", "inputs_embeds")]
        tokens = next((t for t in given if t is not None), None)
        if not isinstance(tokens, torch.Tensor) or tokens.ndim < 2:
            raise LayoutError(f"{where}: expected the (batch, local seq) tokens as the first input")
        mask = kwargs.get("attention_mask")
        if hf and mask is not None and not bool(torch.all(mask.bool())):
            raise LayoutError(f"{where}: an attention_mask that masks tokens (padding) is not supported; context "
                              f"parallel attention is causal over global positions only")
        if hf and mask is not None:
            kwargs["attention_mask"] = None   # all ones: the causal mask by global positions is the whole mask
        pos = positions_of_local(tokens.shape[1], kernel.size, kernel.rank, tokens.device)  # checks the length
        if kwargs.get(arg) is None and len(args) < 2:
            kwargs[arg] = pos.unsqueeze(0) if hf else pos
        return args, kwargs
    return hook


def apply_context_parallel(model: nn.Module, mesh: DeviceMesh, cp_dim: str = "cp", variant: str = "ring") -> nn.Module:
    """Make ``model`` (its root: the repo Llama or a transformers causal LM) context parallel over
    the ``cp_dim`` dimension of ``mesh``. All or nothing; returns ``model``. Feed it the shards of
    ``shard_batch(mesh[cp_dim], tokens, targets)``."""
    return parallelize_module(model, mesh, {"": ContextParallel(variant=variant)}, mesh_dim=cp_dim, strict=True)
