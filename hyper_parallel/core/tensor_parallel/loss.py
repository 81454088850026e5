"""Loss parallel: cross entropy on vocabulary-sharded logits without gathering them.

With the LM head column-wise and its output left as a Shard(-1) DTensor, the full (b, s, V)
logits never exist on one rank: the softmax max, sum and target logit are reduced across the
shards instead (b*s scalars per all-reduce, Megatron's vocab-parallel cross entropy). torch's
DTensor dispatcher already implements the sharded log-softmax / NLL ops well, so inside
``loss_parallel()`` plain ``F.cross_entropy`` on a DTensor takes that path; we add the check
that the logits really are vocabulary-sharded, with an error a user can act on.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel as _torch_loss_parallel

from hyper_parallel.errors import LayoutError


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Context in which F.cross_entropy / nll_loss accept Shard(-1) DTensor logits.

    Both the loss and its ``backward()`` must run inside the context.
    """
    with _torch_loss_parallel():
        yield


def vocab_parallel_cross_entropy(logits: DTensor, target: torch.Tensor, *, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of (..., V) logits sharded on the vocabulary; returns a replicated loss.

    Call ``backward()`` on the result inside ``loss_parallel()``.
    """
    if not isinstance(logits, DTensor):
        raise LayoutError(
            "vocab_parallel_cross_entropy: logits must be a DTensor sharded on the last dim; "
            f"got a plain {type(logits).__name__} (set use_local_output=False on the LM head)"
        )
    last = logits.ndim - 1
    if not any(isinstance(p, Shard) and p.dim % logits.ndim == last for p in logits.placements):
        raise LayoutError(
            f"vocab_parallel_cross_entropy: logits placements {logits.placements} are not sharded on "
            f"the vocabulary (last) dim; the LM head needs output_layouts=Shard(-1)"
        )
    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=ignore_index,
                               reduction=reduction)
