"""FSDP2's "returned a view" warning is silenced for the module whose caller only reads its output
(the root's logits, a pipeline stage's boundary activation) and for no other module, without
repeating other warnings Python shows once per location."""
import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from hyper_parallel.core.dtensor.fsdp_outputs import read_only_output
from hyper_parallel.local import fake_world


class _ViewOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).view(-1)


class _Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _ViewOut()
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.block(x).view(-1, 4)).view(-1)


def test_only_the_read_only_modules_view_warning_is_silenced():
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,))
        model = _Root()
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)

        def warned(read_only: bool) -> list[str]:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                if read_only:
                    read_only_output(model)
                    read_only_output(model)   # added once
                    assert sum(1 for f in warnings.filters if f[1] is not None and "FSDP_Root" in f[1].pattern) == 1
                model(torch.ones(2, 4))
                model(torch.ones(2, 4))
            return sorted({str(w.message).split(")")[0] for w in seen if "returned a view" in str(w.message)})

        assert warned(False) == ["FSDP2-wrapped module (FSDP_Root", "FSDP2-wrapped module (FSDP_ViewOut"]
        assert warned(True) == ["FSDP2-wrapped module (FSDP_ViewOut"]   # the block's still warns


def test_marking_an_output_read_only_keeps_other_once_warnings_once():
    """No filter churn per call: a "once"-per-location warning elsewhere is not repeated."""
    model = nn.Linear(2, 2)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            read_only_output(model)
            warnings.warn("a once-per-location warning", UserWarning)
    assert sum("once-per-location" in str(w.message) for w in seen) == 1
