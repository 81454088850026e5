"""parallelize_module gives every holder of a parameter it replaces the replacement.

HF's LM heads hold the decoder's bias twice (BERT: ``cls.predictions.bias`` is
``cls.predictions.decoder.bias``); a style replaces it on the decoder only. Left alone, the
parent would keep the old tensor: a second parameter that no forward uses, so its gradient is
None while the model's state names it, and an optimizer would step a copy."""
import pytest
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from hyper_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from hyper_parallel.errors import StyleSpecError
from hyper_parallel.local import fake_world


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = nn.Linear(16, 16)
        self.decoder = nn.Linear(16, 32)
        self.bias = nn.Parameter(self.decoder.bias.detach().clone())
        self.decoder.bias = self.bias   # BertLMPredictionHead's tie

    def forward(self, x):
        return self.decoder(self.dense(x))


@pytest.fixture(scope="module")
def mesh():
    with fake_world(4):
        yield init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))


def test_holder_of_a_replaced_parameter_gets_the_replacement(mesh):
    head = Head()
    dense_weight = head.dense.weight
    parallelize_module(head, mesh, {"decoder": ColwiseParallel()})
    assert head.bias is head.decoder.bias and isinstance(head.bias, DTensor)
    assert head.bias.placements == (Shard(0),)
    assert head.dense.weight is dense_weight   # a parameter no style replaced stays as it was
    names = [n for n, _ in head.named_parameters()]
    assert names == ["bias", "dense.weight", "dense.bias", "decoder.weight"]


def test_rollback_restores_every_holder(mesh):
    head = Head()
    old = head.bias
    head.dense.weight = head.decoder.weight = nn.Parameter(head.decoder.weight.detach()[:16].clone())
    with pytest.raises(StyleSpecError, match="tied parameters need one layout"):
        parallelize_module(head, mesh, {"decoder": ColwiseParallel(), "dense": RowwiseParallel()})
    assert head.bias is old and head.decoder.bias is old and not isinstance(old, DTensor)
