"""Graph capture: an nn.Module (real or meta) -> ModelGraph, the planner's IR.

``capture(model, batch=(8, 4096))`` exports the model on meta tensors (one trace per distinct
repeated block), measures every op's FLOPs/bytes/saved tensors, and recognises roles.
"""
from autoplan.capture.capture import capture
from autoplan.capture.inputs import BatchSpec
from autoplan.capture.ir import BlockGroup, Edge, ModelGraph, ModuleInfo, Node, TensorMeta
from autoplan.capture.opcost import register_flop_formulas
from autoplan.capture.views import DistinctOp, FlowStep, dataflow_frame

__all__ = [
    "BatchSpec",
    "BlockGroup",
    "DistinctOp",
    "Edge",
    "FlowStep",
    "ModelGraph",
    "ModuleInfo",
    "Node",
    "TensorMeta",
    "capture",
    "dataflow_frame",
    "register_flop_formulas",
]
