"""``torch.compile`` of a parallelized model: one setting, applied in place, counted.

A plan's runner compiles after every parallelism is applied (tensor/sequence/expert/context
styles, recomputation, the pipeline cut, FSDP), the way torchtitan users run it:

- ``blocks``: each repeated block (decoder layer) is compiled on its own -- torchtitan's recipe;
  FSDP's hooks stay at the block's edges, so a block is one graph.
- ``model``: each root (the model, or each pipeline stage and an MPipe tower) is compiled whole.
  Under FSDP its hooks still split the graph at every FSDP unit: that is torch's behaviour, not
  an error, and the graph-break count says so.
- ``none``: eager.

Compiling is in place (``nn.Module.compile``): the module objects, their parameters and state-dict
keys stay what they were (no ``_orig_mod.`` prefix), so a checkpoint saved compiled resumes eager
and back. Every identical block shares one compiled code object; a model whose blocks differ by a
Python constant (transformers' ``layer_idx``) recompiles per block, so the recompile limit is
raised to the block count and hitting it is an error, never a silent fall back to eager.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch._dynamo
import torch.nn as nn
from torch._dynamo.utils import counters as _dynamo_counters

from hyper_parallel.errors import AsyncTPError, CompileError

log = logging.getLogger(__name__)

COMPILE_MODES = ("none", "blocks", "model")
TORCH_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_ARGS = ("mode", "backend", "torch_mode", "fullgraph", "async_tp")


def backends() -> list[str]:
    """The backend names ``torch.compile`` accepts here."""
    return sorted(torch._dynamo.list_backends(exclude_tags=()))


@dataclass(frozen=True)
class CompileSpec:
    """What to compile (``mode``), with which ``backend`` and torch ``torch_mode``; ``fullgraph``
    makes any graph break inside a compiled part an error; ``async_tp`` turns on inductor's
    micro-pipeline TP pass for the plan's TP group (``hyper_parallel.core.async_tp``: needs a
    compiled mode, inductor, and CUDA with NCCL where it is applied)."""

    mode: str = "none"
    backend: str = "inductor"
    torch_mode: str | None = None
    fullgraph: bool = False
    async_tp: bool = False

    def __post_init__(self) -> None:
        if self.mode not in COMPILE_MODES:
            raise CompileError(f"compile: mode={self.mode!r} is not one of {list(COMPILE_MODES)}")
        if not isinstance(self.backend, str) or self.backend not in backends():
            raise CompileError(f"compile: backend={self.backend!r} is not a torch.compile backend here; "
                               f"valid: {backends()}")
        if self.torch_mode not in TORCH_MODES:
            raise CompileError(f"compile: torch_mode={self.torch_mode!r} is not one of {list(TORCH_MODES)}")
        if not isinstance(self.fullgraph, bool):
            raise CompileError(f"compile: fullgraph={self.fullgraph!r} must be a bool")
        if not isinstance(self.async_tp, bool):
            raise CompileError(f"compile: async_tp={self.async_tp!r} must be a bool")
        if self.async_tp and (not self.enabled or self.backend != "inductor"):
            raise AsyncTPError(f"compile: async_tp=True with mode={self.mode!r}, backend={self.backend!r}: the fusing "
                               "is inductor's micro-pipeline TP pass, so it needs mode 'blocks' or 'model' and backend "
                               "'inductor'")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @classmethod
    def of(cls, value: Any) -> "CompileSpec":
        """A spec from ``None`` / ``False`` (eager), a mode name, a dict of the fields, or a spec."""
        if isinstance(value, CompileSpec):
            return value
        if value is None or value is False:
            return cls()
        if isinstance(value, str):
            return cls(mode=value)
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(_ARGS))
            if unknown:
                raise CompileError(f"compile: unknown key(s) {unknown}; valid: {list(_ARGS)}")
            return cls(**value)
        raise CompileError(f"compile: expected None, one of {list(COMPILE_MODES)}, a dict of {list(_ARGS)} or a "
                           f"CompileSpec, got {type(value).__name__} {value!r}")

    def to_dict(self) -> dict:
        return {"mode": self.mode, "backend": self.backend, "torch_mode": self.torch_mode,
                "fullgraph": self.fullgraph, "async_tp": self.async_tp}


def default_compile_mode(device_type: str) -> str:
    """Per-block compile on accelerators, eager on CPU (compile time dominates short CPU runs)."""
    return "none" if device_type == "cpu" else "blocks"


def _counters() -> tuple[int, int]:
    return int(_dynamo_counters["stats"]["unique_graphs"]), int(sum(_dynamo_counters["graph_break"].values()))


class CompiledParts:
    """What a runner compiled, and how many graphs and graph breaks dynamo has made since (dynamo's
    counters are per process: read them for one runner at a time)."""

    def __init__(self, spec: CompileSpec, parts: list[nn.Module]):
        self.spec, self.parts = spec, parts
        self._start = _counters()

    def stats(self) -> dict[str, int]:
        """{"graphs": compiled graphs, "graph_breaks": graph breaks} since compiling (0, 0 eager)."""
        graphs, breaks = _counters()
        return {"graphs": graphs - self._start[0], "graph_breaks": breaks - self._start[1]}


def _raise_recompile_limit(n_parts: int) -> None:
    config = torch._dynamo.config
    need = max(8, 2 * n_parts)
    if config.recompile_limit < need:
        config.recompile_limit = need
    if config.accumulated_recompile_limit < 4 * need:
        config.accumulated_recompile_limit = 4 * need
    config.fail_on_recompile_limit_hit = True


def compile_parts(spec: CompileSpec, blocks: Iterable[nn.Module], roots: Iterable[nn.Module],
                  where: str = "compile") -> CompiledParts:
    """Compile ``blocks`` (mode "blocks") or ``roots`` (mode "model") in place; nothing for "none".
    A "blocks" spec for a model without repeated blocks is refused: there is nothing to compile
    per block, and compiling something else instead would not be what was asked."""
    spec = CompileSpec.of(spec)
    if not spec.enabled:
        return CompiledParts(spec, [])
    parts = list(blocks) if spec.mode == "blocks" else list(roots)
    if not parts:
        raise CompileError(f"{where}: compile mode {spec.mode!r} found no "
                           f"{'repeated blocks' if spec.mode == 'blocks' else 'modules'} to compile; "
                           "use mode 'model' (or 'none')")
    # "model": FSDP's hooks split a whole model into one graph per function, so a hook or helper is
    # compiled at every call site it has (q_proj's input, then o_proj's, ...). Automatic dynamic
    # shapes would turn those shapes symbolic after the first recompile, and inductor (torch 2.13)
    # then fails on such graphs (RecursionError in its proxy tracing, seen on the titan Llama at
    # dp=2 x tp=2): static shapes recompile once per call site instead, within a raised limit.
    dynamic = False if spec.mode == "model" else None
    _raise_recompile_limit(len(parts) if spec.mode == "blocks" else 32)
    seen: set[int] = set()
    for part in parts:
        if id(part) in seen:
            continue
        seen.add(id(part))
        part.compile(backend=spec.backend, mode=spec.torch_mode, fullgraph=spec.fullgraph, dynamic=dynamic)
    log.info("%s: compiled %d %s with backend %s", where, len(seen), spec.mode, spec.backend)
    return CompiledParts(spec, parts)
