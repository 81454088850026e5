"""Routing by counts read from the data, run on fake tensors as a balanced router would route.

Verify's dry run executes the plan under FakeTensorMode with MoE routing fixed to the balanced
assignment (hyper_parallel's ``balanced_routing()``, which ExpertParallel's styles follow). Modules
whose own code routes -- JetMoE's mixture of attention heads and its MLP experts read each
expert's token count (``expert_size.tolist()``) and split their rows by it -- cannot run on fake
tensors: the read has no value. Here such a read is answered with 0 and the split whose sizes
then do not add up gets an even share per part (capture's ``even_split``: the balanced router's
counts, one more row for the first parts when the experts do not divide the rows), so the step
runs and its collectives have the sizes the plan predicts (all-reduces of every routed row,
whatever the split). Only integer reads are answered (counts); a read of a flag or a float still fails the dry run,
as before.
"""
from __future__ import annotations

import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.capture.fake import is_fake
from autoplan.capture.fallback import even_split

log = logging.getLogger(__name__)
aten = torch.ops.aten
_SPLITS = (aten.split_with_sizes.default, aten.split_with_sizes_copy.default)


class EvenCounts(TorchDispatchMode):
    """Answers value reads of fake tensors with 0 and evens the splits they size; see module doc."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def _note(self, what: str) -> None:
        log.debug("dry run: %s on fake tensors answered as a balanced router", what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.item.default) and args and is_fake(args[0]) and \
                not args[0].is_floating_point() and args[0].dtype != torch.bool:   # counts only
            self.reads += 1
            return 0
        if func in _SPLITS and self.reads:
            args = even_split(func, args, kwargs, self._note)
        return func(*args, **kwargs)
