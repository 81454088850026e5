"""What this rank holds of a parallelized model, under the original model's names.

Checkpoints, pretrained weights and initial values are all keyed by the fully-qualified names of
the model the plan was applied to. A data/tensor-parallel runner trains that one module; a
pipeline rank holds one or more stage modules (hyper_parallel's ``split_model`` registers each
unit under its original path), presented here as one module holding all its units (no copies),
so one state dict, one optimizer mapping and one materialisation cover what this rank holds
(with what a stage shares besides its units -- RoPE modules and tables -- and an MPipe tower,
which every pipeline rank holds and steps, under their original names too).
"""
from __future__ import annotations

import torch.nn as nn


def _attach(root: nn.Module, fqn: str, module: nn.Module) -> None:
    *path, leaf = fqn.split(".")
    parent = root
    for part in path:
        if part not in parent._modules:
            parent.add_module(part, nn.Module())
        parent = parent._modules[part]
    parent.add_module(leaf, module)


def held_module(runner) -> nn.Module:
    """The module whose state dict is this rank's share of the model, under original names."""
    stages = getattr(runner, "stages", None)
    if stages is None:
        return runner.model
    view = nn.Module()
    for st in stages:
        stage = st.module
        for fqn in stage.units:
            _attach(view, fqn, stage.get_submodule(fqn))
        for name, sub in stage.named_modules():   # what the stage shares besides its units (HF rotary)
            if name and (sub._parameters or sub._buffers) and not any(
                    name == u or name.startswith(u + ".") for u in stage.units):
                _attach(view, name, sub)
        for name, buf in stage._buffers.items():  # the model's own buffers a stage keeps (titan's rope)
            if buf is not None and name not in view._buffers:
                view.register_buffer(name, buf, persistent=name not in stage._non_persistent_buffers_set)
    pre = getattr(getattr(runner, "schedule", None), "preprocess", None)
    if pre is not None:   # a tower every pipeline rank holds and steps (MPipe)
        name = next((n for n, m in runner.root.named_modules() if m is pre.module), None)
        if name:
            _attach(view, name, pre.module)
    return view
