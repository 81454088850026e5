"""Expert parallelism: MoE experts split over an ``ep`` mesh dimension, tokens moved by all-to-all.

- ``ExpertParallel``: the style (registered with the other styles, so plans can name it)
- ``DenseExpertsParallel``: experts that run all experts on pre-scaled tokens (Llama-4), split over tp
- ``FlatExpertsParallel``: experts held as flat ``(E * F, H)`` weights (DBRX), split on F over tp
- ``PairedExpertsParallel``: experts held as an up and a down module of 3-D weights (JetMoE), split over tp
- ``balanced_routing`` / ``balanced_assignment``: the deterministic routing dry runs use
- ``expert_parallel_collectives``: the traffic the style issues per layer per step
- ``grouped_mm``: the grouped expert GEMM (torch's kernel where it applies, a loop otherwise)
"""
from hyper_parallel.core.expert_parallel.dense import DenseExpertsParallel
from hyper_parallel.core.expert_parallel.flat import FlatExpertsParallel
from hyper_parallel.core.expert_parallel.paired import PairedExpertsParallel
from hyper_parallel.core.expert_parallel.grouped import grouped_mm
from hyper_parallel.core.expert_parallel.predict import expert_parallel_collectives
from hyper_parallel.core.expert_parallel.routing import balanced_assignment, balanced_routing, balanced_routing_active
from hyper_parallel.core.expert_parallel.style import ExpertParallel

__all__ = ["DenseExpertsParallel", "ExpertParallel", "FlatExpertsParallel", "PairedExpertsParallel",
           "balanced_routing", "balanced_routing_active", "balanced_assignment",
           "expert_parallel_collectives", "grouped_mm"]
