"""The lookup of a vocabulary-sharded embedding, computed without state that outlives an op.

DTensor's own rule for ``embedding(Replicate ids, Shard(0) weight)`` returns a ``_MaskPartial``
output: the mask of ids outside this rank's rows is stored in a buffer on the placement object
during the lookup and read back by the reduction that follows. Eagerly that works; under
``torch.compile`` it does not whenever the lookup and the reduction land in different graphs --
exactly what happens when a whole-model compile falls back to per-function graphs around FSDP's
hooks: the buffer is filled with a fake tensor while tracing, the runtime graph never refills it,
and the next trace mixes two fake modes (or the reduction reads a stale mask). So the styled
module computes the lookup itself: shift the ids into the local rows, look up, zero the rows of
ids another rank owns, and hand back a plain ``Partial`` DTensor -- the same ops and the same
collective (the reduction of the style's output), with nothing held between them.

The module keeps its class's own forward (Gemma-2's scaled embedding multiplies after
``super().forward``): its class is swapped for a subclass that puts this lookup between it and
``nn.Embedding``, as FSDP2 swaps classes, and the swap is recorded so a failed apply undoes it.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard

from hyper_parallel.errors import LayoutError


def vocab_parallel_lookup(module: nn.Embedding, ids: torch.Tensor) -> DTensor:
    """``module``'s lookup of ``ids`` on this rank's rows of the vocabulary, as a Partial sum."""
    weight = module.weight
    if not (isinstance(weight, DTensor) and weight.device_mesh.ndim == 1 and weight.placements == (Shard(0),)):
        got = tuple(weight.placements) if isinstance(weight, DTensor) else type(weight).__name__
        raise LayoutError(f"vocabulary-parallel {type(module).__name__}: the weight must be a DTensor sharded "
                          f"Shard(0) over a 1-D mesh when the module runs, got {got}")
    mesh = weight.device_mesh
    local_ids = ids.to_local() if isinstance(ids, DTensor) else ids
    rows, offset = Shard.local_shard_size_and_offset(module.num_embeddings, mesh.size(), mesh.get_local_rank())
    outside = (local_ids < offset) | (local_ids >= offset + rows)
    shifted = (local_ids - offset).masked_fill(outside, 0)
    pad = module.padding_idx
    pad = pad - offset if pad is not None and offset <= pad < offset + rows else None
    out = F.embedding(shifted, weight.to_local(), pad, module.max_norm, module.norm_type,
                      module.scale_grad_by_freq, module.sparse)
    out = out.masked_fill(outside.unsqueeze(-1), 0)
    return DTensor.from_local(out, mesh, (Partial(),), run_check=False)


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` whose lookup is :func:`vocab_parallel_lookup`."""

    def forward(self, input: torch.Tensor) -> DTensor:  # noqa: A002 - nn.Embedding's name
        return vocab_parallel_lookup(self, input)


_CLASSES: dict[type, type] = {nn.Embedding: VocabParallelEmbedding}


def vocab_parallel_class(cls: type) -> type:
    """The class a vocabulary-sharded module of class ``cls`` (nn.Embedding or a subclass) takes:
    ``cls`` first, so its own forward still runs, then the lookup, then nn.Embedding. It keeps
    ``cls``'s name, so reprs and type names read as before."""
    if cls not in _CLASSES:
        mixed = type(cls.__name__, (cls, VocabParallelEmbedding), {"__module__": cls.__module__})
        mixed.__qualname__ = cls.__qualname__
        _CLASSES[cls] = mixed
    return _CLASSES[cls]
