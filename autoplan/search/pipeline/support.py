"""Whether the runtime can pipeline a model, asked of the runtime itself.

A pipelined plan applies only if ``hyper_parallel``'s split can cut the model (its forward traces
into one block stack with units around it -- an encoder-decoder is refused, naming its two stacks)
and the stages compute the model's function. A stage runs the model's own forward with the other
stages' units stood in for; a forward whose data flow the stand-ins and the carried values
(hyper_parallel's carried.py: Qwen3-VL's DeepStack levels) cannot carry would train something else
once cut. So the model is cut at every boundary on a small copy and run both ways: the two outputs
must be equal.

The comparison must be able to see what a spine can get wrong: a sliding window or attention chunk
the spine does not honour changes nothing on a sequence shorter than the window (EXAONE-4: gap 0.0
at 8 and 16 tokens, 2.14 at 32, and pipelined plans trained wrong gradients). So the sequence is
longer than every window/chunk length the small copy's config declares (those are shrunk to a few
tokens, ``shrink.WINDOW``), and every parameter of the copy is perturbed from its initialisation,
so a skipped norm scale or bias shows.
"""
from __future__ import annotations

import dataclasses
import json
import logging

import torch
import torch.nn as nn

from autoplan import disk_cache
from autoplan.capture import graph_cache
from autoplan.capture import image_inputs as image_inputs_module
from autoplan.capture.image_inputs import ImageBatch, image_inputs
from autoplan.verify import shrink
from autoplan.verify.shrink import attention_extents, recipe_for
from hyper_parallel.core.pipeline_parallel import carried, forward_split, split
from hyper_parallel.core.pipeline_parallel.split import pipeline_units, spine_for, split_gap
from hyper_parallel.errors import StageSplitError

log = logging.getLogger(__name__)

# the stages run the model's own code: in fp32 on the CPU the outputs are bit-equal when the split
# computes the same function
GAP_TOLERANCE = 1e-5
GUARD_MARGIN = 8      # tokens beyond the longest window/chunk: several positions fall outside it
GUARD_MAX_TOKENS = 256
GUARD_MIN_TOKENS = 8
GUARD_PERTURB = 0.2   # noise on every parameter of the copy: norms far from 1, biases far from 0


def pipeline_layout(model: nn.Module) -> tuple[str | None, tuple[str, ...]]:
    """(``pipeline_refusal(model)``, the runtime's pipeline units when it can cut the model, else
    ()), kept on disk (``autoplan.disk_cache``) for a model whose stages run its own forward.

    Why: reading the units traces the whole model's forward on fake tensors and the guard runs a
    small copy -- 2-4 s of a first 70B-405B plan, every process. Both are a function
    of what the capture cache's model key holds (module tree, configs, class sources) and of the
    split, guard and shrink code (the entry's version). A model a spine runs is not cached: the
    spine names its units without a trace, and spines can be registered at run time."""
    key = graph_cache.model_key(model) if spine_for(model) is None else None
    version = disk_cache.code_version(__file__, split.__file__, forward_split.__file__, carried.__file__,
                                      shrink.__file__, graph_cache.__file__, image_inputs_module.__file__)
    raw = disk_cache.load("pipeline_layout", version, key) if key is not None else None
    if raw is not None:
        try:
            refusal, units = json.loads(raw)
            return refusal, tuple(units)
        except ValueError:
            log.debug("pipeline layout cache: damaged entry, computed again")
    refusal = pipeline_refusal(model)
    units = tuple(pipeline_units(model)) if refusal is None else ()
    if key is not None:
        disk_cache.store("pipeline_layout", version, key, json.dumps([refusal, list(units)]).encode())
    return refusal, units


def pipeline_refusal(model: nn.Module) -> str | None:
    """Why ``model`` cannot be cut into pipeline stages by the runtime; None when it can."""
    try:
        pipeline_units(model)
    except StageSplitError as exc:
        return f"pipeline parallelism needs the runtime to cut the model into stages: {exc}"
    spine = spine_for(model)
    how = f"the runtime's {spine.name!r} spine" if spine is not None else "the runtime's stages (the model's forward)"
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or not getattr(config, "model_type", None):
        return None   # a model written with its spine (the repo's Llama and VL model)
    key = (type(model).__name__, config.to_json_string(use_diff=False))
    if key not in _GAPS:
        try:
            _GAPS[key] = _small_copy_gap(model)
        except Exception as exc:  # noqa: BLE001 - a copy that cannot be built or run proves nothing: refuse
            return (f"{how} could not be checked against {type(model).__name__}'s forward on a small copy "
                    f"({type(exc).__name__}: {str(exc)[:200]})")
    gap = _GAPS[key]
    if gap > GAP_TOLERANCE:
        return (f"{how}, cut at every boundary of a small copy of {type(model).__name__}, differs from its forward "
                f"by {gap:.3g} (a value besides the hidden state and the carried keywords crosses a stage boundary)")
    return None


_GAPS: dict[tuple[str, str], float] = {}   # (class, config) -> gap: copies of one architecture share it


def _small_copy_gap(model: nn.Module) -> float:
    """The spine gap of a small copy of ``model`` (built from its config, fp32, on the CPU)."""
    recipe = dataclasses.replace(recipe_for(model, [2], seed=0), perturb=GUARD_PERTURB)
    small = recipe.build().eval()
    vocab = int(getattr(small.config.get_text_config(), "vocab_size", 0) or 0)
    if vocab < 2:
        return float("inf")
    images = image_inputs(small)
    length = guard_length(small.config) + (images.per_image if isinstance(images, ImageBatch) else 0)
    tokens = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    extra = {}
    if images is not None:   # a VL model runs with its images: the tower, the merge, M-RoPE positions
        extra = dict(images(tokens))
        tokens = extra.pop("input_ids", tokens)
    return split_gap(small, tokens, extra)


def guard_length(config) -> int:
    """Tokens the guard compares on: past every window/chunk ``config`` declares, by a margin.
    A window longer than ``GUARD_MAX_TOKENS`` (a config the shrink left long) cannot be seen:
    raises, and the caller refuses."""
    extents = attention_extents(config.to_dict())
    longest = max(extents.values(), default=0)
    if longest + GUARD_MARGIN > GUARD_MAX_TOKENS:
        raise StageSplitError(f"window/chunk settings {extents} exceed the {GUARD_MAX_TOKENS} tokens the guard runs")
    return max(GUARD_MIN_TOKENS, longest + GUARD_MARGIN)
