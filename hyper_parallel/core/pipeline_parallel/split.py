"""Stage split: cut a model at FQNs and build this rank's stage modules, keeping the original FQNs.

A stage holds the units between two cuts (a cut ``"model.layers.2"`` starts a stage at that unit).
Stage modules reference the original submodules (no copy), registered under their original paths,
so TP plans, FSDP and checkpoints address ``model.layers.2.self_attn.q_proj`` exactly as on the
full model, and parameters tied inside the model (embedding and head) stay one Parameter when one
rank holds both stages.

What a stage runs: for any model, the model's own forward between its cuts (forward_split.py:
units read from a trace of the forward, the other stages' units stood in for at their call sites).
Spines -- adapters that call a family's units in order themselves -- remain only for the repo's
own models whose step carries inputs a forward does not take (the torchtitan Llama's context-
parallel ``positions``, the repo VL model's MPipe tower output); ``register_spine`` adds one.
transformers' VL models need none: their tower is a module the token-only forward does not call
(``ForwardTrace.side``), held by stage 0 or run by MPipe (image_features.py), and their forward
takes the tower's output precomputed. :func:`split_gap` checks either kind against the model's forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from hyper_parallel.core.pipeline_parallel.forward_split import (STAGE_TOKENS, ForwardStage, attach, model_kwargs,
                                                                 trace_forward)
from hyper_parallel.errors import StageSplitError


@dataclass(frozen=True)
class Spine:
    """How to run a model family one unit at a time.

    ``units(model)``: FQNs in execution order. ``shared(model)``: module FQNs every stage keeps
    (no parameters expected). ``buffers(model)``: root buffer names every stage keeps.
    ``context(stage, h, kwargs)``: side inputs computed at the start of each stage.
    ``call(stage, fqn, module, h, ctx)``: run one unit.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    units: Callable[[nn.Module], list[str]]
    call: Callable[..., Any]
    context: Callable[..., dict] = lambda stage, h, kwargs: {}
    shared: Callable[[nn.Module], list[str]] = lambda model: []
    buffers: Callable[[nn.Module], list[str]] = lambda model: []
    context_on_input: bool = False  # also build the context before the first stage's first unit


# ---- the repo's torchtitan-style Llama -------------------------------------------------------

def _titan_matches(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("tok_embeddings", "layers", "norm", "output", "rope"))


def _titan_units(m: nn.Module) -> list[str]:
    return ["tok_embeddings"] + [f"layers.{k}" for k in m.layers.keys()] + ["norm", "output"]


def _titan_context(stage, h, kwargs) -> dict:
    """RoPE for the stage's blocks: the whole table, or -- when the step passes the tokens'
    global ``positions`` (context parallel: a rank holds a head and a tail chunk of each sequence)
    -- the table's rows at those positions, as the model's own forward indexes it."""
    positions = kwargs.get("positions")
    return {"rope": stage.rope if positions is None else stage.rope[positions]}


def _titan_call(stage, fqn, module, h, ctx):
    if fqn.startswith("layers."):
        # the whole table (or its rows at the given positions): h may be a local sequence shard
        # (sequence parallel); attention slices the table to the length it sees after gathering
        return module(h, ctx.get("rope", stage.rope))
    return module(h)


# ---- a vision-language model: the repo Llama plus a ``visual`` tower (autoplan.models.vision_language) ----
# The tower is not a unit: MPipe (mpipe.py) runs it and hands its output to stage 0 as the step
# kwarg ``vision`` (a tensor, or a tuple of embeddings and DeepStack levels). The model's
# parameterless ``image_merge`` module, kept by every stage, puts the features at image tokens.

def _vl_matches(m: nn.Module) -> bool:
    return _titan_matches(m) and hasattr(m, "visual") and hasattr(m, "image_merge")


def _vl_context(stage, h, kwargs) -> dict:
    return {**_titan_context(stage, h, kwargs), "vision": kwargs.get("vision")}


def _vl_call(stage, fqn, module, h, ctx):
    if fqn == "tok_embeddings":
        vision = ctx.get("vision")
        if vision is None:
            raise StageSplitError("vision-language stage 0: no tower output; run the tower with MPipe "
                                  "(Preprocess(into='vision')) or pass vision= to the step")
        emb, *levels = vision if isinstance(vision, (tuple, list)) else (vision,)
        ctx.update(tokens=h, levels=levels)
        return stage.image_merge.merge(module(h), h, emb)
    out = _titan_call(stage, fqn, module, h, ctx)
    if fqn.startswith("layers."):
        i = int(fqn.split(".")[1])
        levels = ctx.get("levels")
        if levels is None and i < stage.deepstack_levels:
            raise StageSplitError(f"vision-language: {fqn} adds DeepStack level {i} but sits on stage "
                                  f"{stage.stage_index}; the first {stage.deepstack_levels} layers must be on stage 0")
        if levels is not None and i < len(levels):
            out = stage.image_merge.add_level(out, ctx["tokens"], levels[i])
    return out


SPINES: list[Spine] = [
    Spine("vision-language", _vl_matches, _titan_units, _vl_call, context=_vl_context,
          buffers=lambda m: ["rope"], shared=lambda m: ["image_merge"], context_on_input=True),
    Spine("torchtitan-llama", _titan_matches, _titan_units, _titan_call, context=_titan_context,
          buffers=lambda m: ["rope"]),
]


def register_spine(spine: Spine) -> None:
    """Teach the split a new model family (checked before the built-in ones)."""
    SPINES.insert(0, spine)


def spine_for(model: nn.Module) -> Spine | None:
    """The spine that runs ``model``'s stages, or None: its stages run the model's own forward."""
    for spine in SPINES:
        if spine.matches(model):
            return spine
    return None


def pipeline_units(model: nn.Module) -> list[str]:
    """The units a cut may start a stage at, in execution order (the planner's stage boundaries).
    Raises StageSplitError naming why when the model cannot be cut (forward_split.trace_forward)."""
    spine = spine_for(model)
    return list(spine.units(model)) if spine is not None else trace_forward(model).units


def prepare_split(model: nn.Module) -> None:
    """Read the model's forward (once per architecture) while its modules are still plain: the
    pipeline runner calls it before tensor parallelism shards them."""
    if spine_for(model) is None:
        trace_forward(model)


class StageModule(nn.Module):
    """One pipeline stage: the units between two cuts, under their original FQNs.

    ``forward(x, **kwargs)`` takes the model input on the first stage and the previous stage's
    hidden state elsewhere; kwargs (e.g. an attention mask) reach every stage. Without a spine the
    stage runs the model's own forward (forward_split.ForwardStage) between its cuts.
    """

    def __init__(self, model: nn.Module, spine: Spine | None, units: Sequence[str], stage_index: int,
                 n_stages: int, next_unit: str | None = None, side: bool = True):
        super().__init__()
        self.spine = spine
        self.units = list(units)
        self.stage_index = stage_index
        self.n_stages = n_stages
        self.config = getattr(model, "config", None)
        visual = getattr(model, "visual", None)
        self.deepstack_levels = len(getattr(visual, "deepstack", ()))
        if spine is None:
            trace = trace_forward(model)
            shared = trace.shared
            # the model root is not registered: the stage holds only its own units' parameters
            object.__setattr__(self, "_forward_stage",
                               ForwardStage(model, trace, self.units, stage_index, next_unit))
        else:
            shared = spine.shared(model)
        for fqn in list(units) + list(shared):
            self._attach(fqn, model.get_submodule(fqn))
        if spine is None and side and stage_index == 0:   # a tower's parameters held by its container
            for fqn in trace.side_params:
                attach(self, fqn, model.get_parameter(fqn))
        for name in (spine.buffers(model) if spine is not None else []):
            self.register_buffer(name, getattr(model, name), persistent=False)

    def _attach(self, fqn: str, module: nn.Module) -> None:
        attach(self, fqn, module)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.n_stages - 1

    def forward(self, x, *carried, **kwargs):
        """``carried``: what the previous stage sent besides its hidden state (a decoder's values
        made from the tower's output, forward_split.ForwardStage; carried.py)."""
        if self.spine is None:
            return self._forward_stage(x, kwargs, carried)
        if carried:
            raise StageSplitError(f"stage {self.stage_index}: the {self.spine.name!r} spine takes one hidden state, "
                                  f"got {1 + len(carried)} values")
        h, ctx = x, None
        for i, fqn in enumerate(self.units):
            if ctx is None and (self.spine.context_on_input or not (self.is_first and i == 0)):
                # side inputs need the hidden state (or, context_on_input, only the step's kwargs)
                ctx = self.spine.context(self, h, kwargs)
            h = self.spine.call(self, fqn, self.get_submodule(fqn), h, ctx or {})
        return h

    def extra_repr(self) -> str:
        return f"stage {self.stage_index}/{self.n_stages}: {self.units[0]} .. {self.units[-1]}"


def stage_units(model: nn.Module, cuts: Sequence[str], side: bool = True) -> list[list[str]]:
    """The unit FQNs of each stage for cut points ``cuts`` (each the first unit of a stage); the
    first stage also holds the units the forward runs between the embedding and the first block
    (position embeddings, embedding norms), which are no cut points, and -- ``side`` -- the modules
    the forward calls only on images (a VL tower placed on stage 0; without ``side`` MPipe runs it)."""
    units = pipeline_units(model)
    cuts = list(cuts)
    where = []
    for c in cuts:
        if c not in units:
            near = [u for u in units if u.startswith(c.rsplit(".", 1)[0])][:4]
            raise StageSplitError(f"split_model: cut {c!r} is not a stage boundary of "
                                  f"{type(model).__name__}; boundaries look like {near or units[:4]}")
        where.append(units.index(c))
    if where != sorted(set(where)) or (where and where[0] == 0):
        raise StageSplitError(f"split_model: cuts {cuts} must be distinct, in model order and after "
                              f"the first unit {units[0]!r}")
    bounds = [0] + where + [len(units)]
    groups = [units[a:b] for a, b in zip(bounds, bounds[1:])]
    if spine_for(model) is None:
        trace = trace_forward(model)
        groups[0] = groups[0][:1] + trace.lead + groups[0][1:] + (trace.side if side else [])
    return groups


def _blocks(model: nn.Module, units: list[str]) -> list[str]:
    """The blocks among ``units`` (a spine's: between the embedding and the final norm and head)."""
    return units[1:-2] if spine_for(model) is not None else trace_forward(model).blocks


def even_cuts(model: nn.Module, n_stages: int) -> list[str]:
    """Cut points that spread the blocks evenly (embedding with the first stage, norm and head
    with the last); with more stages than blocks, the embedding, norm and head get stages too."""
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise StageSplitError(f"even_cuts: n_stages={n_stages!r} must be an integer >= 1")
    units = pipeline_units(model)
    blocks = _blocks(model, units)
    pool = blocks if n_stages <= len(blocks) else units
    if n_stages > len(units):
        raise StageSplitError(f"even_cuts: {n_stages} stages need at least as many units; "
                              f"{type(model).__name__} has {len(units)}")
    per, extra = divmod(len(pool), n_stages)
    starts, i = [], 0
    for s in range(n_stages - 1):
        i += per + (1 if s < extra else 0)
        starts.append(pool[i])
    return starts


def split_model(model: nn.Module, cuts: Sequence[str], stage_indices: Sequence[int] | None = None,
                side: bool = True) -> list[StageModule]:
    """Build the stage modules ``stage_indices`` (default: all) of ``model`` cut at ``cuts``
    (``side``: stage 0 holds the VL tower, see :func:`stage_units`)."""
    spine = spine_for(model)
    groups = stage_units(model, cuts, side)
    idx = range(len(groups)) if stage_indices is None else list(stage_indices)
    for i in idx:
        if not 0 <= i < len(groups):
            raise StageSplitError(f"split_model: stage {i} does not exist; {len(cuts)} cuts make "
                                  f"{len(groups)} stages")
    tied = tied_parameters(model, cuts, side)
    stages = [StageModule(model, spine, groups[i], i, len(groups),
                          groups[i + 1][0] if i + 1 < len(groups) else None, side) for i in idx]
    for st in stages:
        st.tied_groups = tied  # every rank needs the full list: the gradient sum is collective
    return stages


def split_gap(model: nn.Module, tokens: torch.Tensor, extra: dict | None = None) -> float:
    """Largest absolute difference between ``model``'s output and its stages run in order on
    ``tokens`` (and the step's ``extra`` keywords, e.g. a VL model's images -- ``tokens`` then
    with the image tokens placed): 0 when the split computes the model's function. Without a
    spine the model is cut at every boundary (every stage's stand-ins run; each stage gets the
    step's keywords and token ids, as the pipeline runner passes them); a spine runs as one stage
    holding every unit (a spine matches models by attributes, and one whose forward does more than
    its units would match and train another function). Run it on a small copy of the model."""
    spine = spine_for(model)
    cuts = [] if spine is not None else pipeline_units(model)[1:]
    extra = dict(extra or {})
    with torch.no_grad():
        want = model(tokens, **({} if spine is not None else model_kwargs(model, extra)))
        h = tokens
        for stage in split_model(model, cuts):
            # a stage's output is its hidden state, or that and the values it carries (carried.py)
            h = stage(*(h if isinstance(h, tuple) else (h,)), sequence_length=tokens.shape[1],
                      **({STAGE_TOKENS: tokens} if spine is None else {}), **extra)
    want = getattr(want, "logits", want)
    want = want[0] if isinstance(want, (tuple, list)) else want
    if not isinstance(want, torch.Tensor) or not isinstance(h, torch.Tensor) or want.shape != h.shape:
        return float("inf")
    return float((want.float() - h.float()).abs().max())


def tied_parameters(model: nn.Module, cuts: Sequence[str], side: bool = True) -> list[dict[int, str]]:
    """Parameters that more than one stage holds: for each, {stage index: FQN in that stage}."""
    groups = stage_units(model, cuts, side)
    holders: dict[int, dict[int, str]] = {}
    for s, units in enumerate(groups):
        for u in units:
            for name, p in model.get_submodule(u).named_parameters(remove_duplicate=False):
                holders.setdefault(id(p), {}).setdefault(s, f"{u}.{name}")
    return [h for h in holders.values() if len(h) > 1]
