"""How a plan's model is run on a batch of token ids: the forward call, its logits, the LM loss.

One place for what every runner and every dry run does the same way (the single-mesh Runner,
the pipeline runner's last stage, verify's dry runs and numerics, the TP probe), so a model
family with a different call convention is taught once.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def output_logits(out):
    """The logits of a model's output: HF models return an object with ``.logits``, plain ones a tensor."""
    return out.logits if hasattr(out, "logits") else out


def forward_tokens(model: nn.Module, tokens: torch.Tensor):
    """The model's output for token ids. Encoder-decoder models (T5, BART) get the tokens as
    the decoder's input too: one call trains both stacks, as a denoising step would. A model with
    inputs besides tokens (a VL model's images) says what they are for given tokens through
    ``model.extra_inputs(tokens) -> dict`` of keyword arguments."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return model(input_ids=tokens, decoder_input_ids=tokens)
    extra = getattr(model, "extra_inputs", None)
    return model(tokens, **(extra(tokens) if callable(extra) else {}))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token cross entropy over (..., vocab) logits."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
