"""A block container whose children only hold blocks (Florence-2's DaViT tower: a ModuleList of
stages, each a ModuleList of blocks) hands FSDP and recomputation the blocks that run, never a
container: ``fully_shard`` of a ModuleList raises."""
from types import SimpleNamespace

import torch.nn as nn

from autoplan.plan.runner import block_modules


def test_block_modules_are_modules_that_run():
    stages = nn.ModuleList([nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.ModuleList([nn.Linear(2, 2)])])
    model = nn.Module()
    model.tower = nn.Module()
    model.tower.blocks = stages
    model.layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    plan = SimpleNamespace(decisions=[{"block_prefix": "tower.blocks"}, {"block_prefix": "layers"},
                                      {"block_prefix": None}])
    blocks = block_modules(model, plan)
    assert blocks == [*model.layers, *stages[0], *stages[1]]
    assert all(type(b).forward is not nn.Module.forward for b in blocks)
