"""The weight operations a runner offers (mixed into both runners): initialise after a meta build,
load pretrained weights, export as a Hugging Face directory. Each is one function elsewhere; this
class only binds them to the runner."""
from __future__ import annotations

import torch

from autoplan.plan.hf_export import export_hf
from autoplan.plan.pretrained import load_pretrained
from autoplan.plan.weights import ModelInit, materialize_runner
from hyper_parallel.core.materialize import InitFn


class HeldWeights:
    """What a runner offers for its weights (mixed into both runners). ``plan.apply`` sets
    ``model_init`` (the original model's init facts) and ``device``."""

    model_init: ModelInit | None = None
    device: torch.device = torch.device("cpu")

    def materialize(self, seed: int = 0, init_fn: InitFn | None = None,
                    init_device: str | torch.device = "cpu") -> "HeldWeights":
        """Give a model applied on meta its initial weights (see :func:`materialize_runner`)."""
        materialize_runner(self, seed=seed, init_fn=init_fn, init_device=init_device)
        return self

    def load_pretrained(self, path, seed: int = 0) -> "HeldWeights":
        """Load a Hugging Face safetensors directory into what this rank holds
        (:func:`autoplan.plan.pretrained.load_pretrained`)."""
        load_pretrained(self, path, seed=seed)
        return self

    def export_hf(self, out, dtype: torch.dtype | None = None):
        """Write the weights as a Hugging Face directory (:func:`autoplan.plan.hf_export.export_hf`)."""
        return export_hf(self, out, dtype=dtype)
