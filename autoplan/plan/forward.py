"""How a plan's model is run on a batch of token ids: the forward call, its logits, the LM loss.

One place for what every runner and every dry run does the same way (the single-mesh Runner,
the pipeline runner's last stage, verify's dry runs and numerics, the TP probe), so a model
family with a different call convention is taught once.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoplan.capture.image_inputs import image_inputs, value_checks_off
from hyper_parallel.core.dtensor.fsdp_outputs import read_only_output


def output_logits(out):
    """The logits of a model's output: HF models return an object with ``.logits``, plain ones a tensor."""
    return out.logits if hasattr(out, "logits") else out


def forward_tokens(model: nn.Module, tokens: torch.Tensor, **extra):
    """The model's output for token ids. Encoder-decoder models (T5, BART) get the tokens as
    the decoder's input too: one call trains both stacks, as a denoising step would.

    A model with inputs besides tokens (a VL model's images) gets them from ``extra`` (the
    step's own, e.g. ``pixel_values=...``), else from its ``model.extra_inputs(tokens) -> dict``
    hook, else -- a transformers VL family -- from the image inputs derived from the model
    (:mod:`autoplan.capture.image_inputs`). Those may return ``input_ids`` (the tokens with image
    tokens placed), which then replace ``tokens``. Every runner, dry run and probe calls this, so
    capture, planning and training see the same inputs."""
    if not extra:
        make = image_inputs(model)
        extra = make(tokens) if make is not None else {}
    extra = dict(extra)
    ids = extra.pop("input_ids", tokens)
    config = getattr(model, "config", None)
    read_only_output(model)   # the logits go to the loss, which only reads them
    with value_checks_off(model, tokens):   # a probe on meta has no token values to count
        if getattr(config, "is_encoder_decoder", False):
            # the extra inputs too (Florence-2's images feed its encoder): capture traces them, so a
            # step without them would leave the modules they reach planned but never run
            return model(input_ids=ids, decoder_input_ids=tokens, **extra)
        return model(ids, **extra)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token cross entropy over (..., vocab) logits."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
