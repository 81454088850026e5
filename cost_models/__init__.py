"""Costs of ops, collectives and memory for the planner: hardware data, roofline, profiles.

Planner-facing API (all offline: nothing here needs a process group or a device):

- hardware: ``load_hardware(name)``, ``list_hardware()``, ``HardwareProfile``, ``Link``
- collectives: ``collective_time(kind, nbytes, group_size, link, algorithm)``, ``wire_bytes``,
  ``tp_layer_collectives``; ``mesh_links(shape, names, hardware)`` -> ``MeshTopology``
- compute: ``ComputeModel(hardware, table).time(spec)``, ``OpSpec``, ``ProfileTable`` (the planner
  builds specs from its captured graphs: ``autoplan.capture.views.specs_from_graph``)
- memory: ``param_specs``, ``model_state_bytes``, ``activation_bytes`` over ``SavedActivation``
  lists (``gpt_layer_activations``, ``llama_block_activations``), ``inflight_microbatches``,
  ``rank_memory``

Profiling (``cost_models.profiler``) and calibration (``cost_models.calibrate``) run on devices;
``autoplan profile | calibrate | hardware | runtime`` (``autoplan.cost_commands``) drives both.
Nothing here imports autoplan: the cost model sits below the planner.
"""
from cost_models.activations import SavedActivation, activation_bytes, gpt_layer_activations, llama_block_activations
from cost_models.collectives import collective_terms, collective_time, tp_layer_collectives, wire_bytes
from cost_models.compute import ComputeModel, category, op_bytes, op_flops
from cost_models.hardware import HardwareProfile, Link, list_hardware, load_hardware
from cost_models.memory import (PRECISIONS, ModelStateBytes, ParamSpec, PrecisionPolicy, inflight_microbatches,
                                model_state_bytes, param_specs, rank_memory)
from cost_models.ops import OpSpec, TensorSpec
from cost_models.profile_table import ProfileTable
from cost_models.topology import MeshDim, MeshTopology, mesh_links, mesh_topology

__all__ = [
    "ComputeModel", "HardwareProfile", "Link", "MeshDim", "MeshTopology", "ModelStateBytes", "OpSpec", "PRECISIONS",
    "ParamSpec", "PrecisionPolicy", "ProfileTable", "SavedActivation", "TensorSpec", "activation_bytes", "category",
    "collective_terms", "collective_time", "gpt_layer_activations", "inflight_microbatches", "list_hardware",
    "llama_block_activations", "load_hardware", "mesh_links", "mesh_topology",
    "model_state_bytes", "op_bytes", "op_flops", "param_specs", "rank_memory",
    "tp_layer_collectives", "wire_bytes",
]
