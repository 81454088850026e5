"""The graph of a model that capture cannot trace: its module tree and parameters, no dataflow.

When export and the hook fallback both fail (JetMoE routes tokens by data-dependent counts that
neither export on meta nor an eager meta forward can size), nothing tells the planner how a
module's tensors flow, so no tensor-parallel or pipeline decision can be proved sound. The model
can still be trained data-parallel (FSDP shards parameters, not computations), which needs only
the parameters: this graph carries them, one opaque node with the whole forward's model FLOPs
(2 per parameter per token, twice that backward), and the reason in ``warnings``. The planner
recognises it by ``method == OPAQUE`` and plans data-parallel only, with the reason in the notes.
"""
from __future__ import annotations

import torch.nn as nn

from autoplan.capture.blocks import assign_blocks, find_blocks, module_tree, type_name
from autoplan.capture.ir import ModelGraph, Node, TensorMeta

OPAQUE = "opaque"


def opaque_graph(model: nn.Module, tokens: int, dtype: str, reason: str) -> ModelGraph:
    """``model``'s parameters and blocks, and one node standing for its forward on ``tokens`` tokens."""
    infos, tied, nparams = module_tree(model)
    groups = find_blocks(model)
    assign_blocks(infos, groups)
    node = Node(name="opaque_forward", op="opaque.forward", module="", module_type=type_name(model), scope=[""],
                args=[], kwargs={}, inputs=[TensorMeta((int(tokens),), "torch.int64")], input_nodes=["input:arg0"],
                outputs=[TensorMeta((int(tokens),), dtype)], flops_fwd=2 * nparams * int(tokens),
                flops_bwd=4 * nparams * int(tokens))
    return ModelGraph(model_type=type_name(model), nodes=[node], edges=[], modules=infos, blocks=groups,
                      tied_parameters=tied, inputs=[], outputs=[], method=OPAQUE, warnings=[reason],
                      num_parameters=nparams)
