"""Selective activation recomputation: the attention core is recomputed in backward, exactly
the ops the planner prices as the core (``autoplan.search.units.work.Work.core``).

The core is every op the attention module runs itself, outside its child modules (the q/k/v/o
projections): RoPE, the score GEMMs, softmax (or the fused attention kernel), the head
reshapes. Those are what Megatron-LM's selective recomputation drops from memory and recomputes
(Korthikanti et al. 2022); the projections' outputs and every collective stay saved, so the
recomputation issues no communication and the plan's collectives are those of no
recomputation. Implemented with torch's selective checkpointing
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the attention module's
forward runs under a non-reentrant checkpoint whose policy saves the outputs of ops that run
inside a child module (tracked with forward hooks) and of collectives, and recomputes the rest.

Registry entry ``Recompute`` (plan section ``parallel.ac``: ``mode`` none | selective | full and,
for selective, the attention ``modules``): full recomputation checkpoints every repeated block,
selective wraps the attention modules; applied after tensor parallel and the pipeline split, before
FSDP (torchtitan's order), so FSDP's gathers sit outside the checkpointed region.
"""
from __future__ import annotations

import functools
import logging

import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torch.distributed._composable import checkpoint as checkpoint_module

from autoplan.errors import PlanSchemaError
from autoplan.parallelisms.base import ApplyTarget, Parallelism, section_error
from hyper_parallel.core.fqn_pattern import fqn_matches

log = logging.getLogger(__name__)
_SAVE_ALWAYS = ("_c10d_functional", "c10d.", "wait_tensor")


class _CorePolicy:
    """Save what child modules produce and every collective; recompute the module's own ops."""

    def __init__(self, module: nn.Module):
        self.depth = 0
        for child in module.children():
            child.register_forward_pre_hook(self._enter, prepend=True)
            child.register_forward_hook(self._leave, always_call=True)

    def _enter(self, *_):
        self.depth += 1

    def _leave(self, *_):
        self.depth -= 1

    def __call__(self, ctx, op, *args, **kwargs):
        name = str(op)
        if self.depth > 0 or any(w in name for w in _SAVE_ALWAYS):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, policy: _CorePolicy):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy), **kwargs)
    return run


def recompute_attention_core(model: nn.Module, patterns: list[str], strict: bool = True) -> list[str]:
    """Wrap the forward of every module matching ``patterns`` (e.g. ``layers.*.attention``) so
    its own ops are recomputed in backward. Returns the wrapped FQNs; with ``strict`` raises
    PlanSchemaError when a pattern matches nothing (a plan for another model; a pipeline stage
    without blocks passes ``strict=False``)."""
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # a KV cache filled in forward changes what the recomputation runs (HF does the same
        # when gradient checkpointing is on); training never reads it
        log.info("selective recomputation: setting %s.config.use_cache=False", type(model).__name__)
        config.use_cache = False
    wrapped = []
    for pattern in patterns:
        hits = [(fqn, m) for fqn, m in model.named_modules() if fqn and fqn_matches(pattern, fqn)]
        if not hits and strict:
            raise PlanSchemaError(f"plan.recompute.modules: pattern {pattern!r} matches no module of "
                                  f"{type(model).__name__} (expected e.g. 'layers.*.attention')")
        for fqn, m in hits:
            m.forward = _checkpointed(m.forward, _CorePolicy(m))
            wrapped.append(fqn)
    log.debug("selective recomputation of %d attention modules", len(wrapped))
    return wrapped


MODES = ("none", "selective", "full")


class Recompute(Parallelism):
    """Activation recomputation: not a mesh dimension, but a per-plan decision the runtime applies
    in its place in the order (after TP and the pipeline split, before FSDP)."""

    name = "ac"
    roles = ()
    order = 30
    schema = {"type": "object", "required": ["mode"], "additionalProperties": False,
              "properties": {"mode": {"enum": list(MODES)}, "modules": {"type": "array", "items": {"type": "string"}}}}

    def default(self) -> dict:
        return {"mode": "none"}

    def check(self, section, data, roles, degree) -> None:
        if section["mode"] != "selective" and section.get("modules"):
            raise section_error("ac", "modules", f"attention modules are listed, but mode is {section['mode']!r} "
                                "(only selective recomputation names modules)")

    def active(self, plan) -> bool:
        return plan.recompute_mode != "none"

    def apply_to_roots(self, plan, target: ApplyTarget) -> None:
        mode = plan.recompute_mode
        if mode == "full":
            config = getattr(target.model, "config", None)
            if getattr(config, "use_cache", False):
                # a KV cache filled in forward would be filled again by the recomputation (keys
                # twice as long); training never reads it (the selective path does the same)
                log.info("full recomputation: setting %s.config.use_cache=False", type(target.model).__name__)
                config.use_cache = False
            for block in target.blocks:
                checkpoint_module(block)
        elif mode == "selective":
            for root in target.roots:  # a pipeline stage without blocks matches nothing: not an error
                recompute_attention_core(root, list(plan.recompute.get("modules", [])), strict=not target.pipelined)
