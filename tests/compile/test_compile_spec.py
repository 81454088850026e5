"""CompileSpec: one setting, checked before anything is compiled; compiling keeps the module's
state-dict keys (no ``_orig_mod.``), so checkpoints do not depend on compilation."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoplan.train.config import TrainConfig
from autoplan.train.errors import TrainConfigError
from autoplan.train.loop import compile_spec
from hyper_parallel.core.compile import CompileSpec, compile_parts, default_compile_mode
from hyper_parallel.errors import CompileError


def test_spec_of_each_form():
    assert CompileSpec.of(None).mode == "none" and not CompileSpec.of(None).enabled
    assert CompileSpec.of("blocks").backend == "inductor"
    spec = CompileSpec.of({"mode": "model", "backend": "aot_eager"})
    assert (spec.mode, spec.backend) == ("model", "aot_eager")
    assert CompileSpec.of(spec) is spec
    assert default_compile_mode("cpu") == "none" and default_compile_mode("cuda") == "blocks"


@pytest.mark.parametrize("value,words", [("layers", "mode='layers'"), ({"mode": "blocks", "backend": "nope"}, "nope"),
                                          ({"mode": "blocks", "fullgrap": True}, "fullgrap"), (3, "int"),
                                          ({"mode": "blocks", "torch_mode": "fast"}, "fast")])
def test_bad_settings_are_typed(value, words):
    with pytest.raises(CompileError, match=words):
        CompileSpec.of(value)


class Block(nn.Module):
    """A block of user code (dynamo does not start a frame in torch.nn's own modules)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x)) + x


def test_in_place_compile_keeps_keys_and_values():
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    keys = list(model.state_dict())
    x = torch.randn(3, 4)
    want = model(x)
    parts = compile_parts(CompileSpec(mode="blocks", backend="aot_eager"), [model[0], model[1]], [model])
    assert list(model.state_dict()) == keys   # no _orig_mod. prefix: a checkpoint loads compiled or not
    assert torch.equal(model(x), want)
    assert parts.stats()["graphs"] >= 1


def test_blocks_without_blocks_is_refused():
    with pytest.raises(CompileError, match="no repeated blocks"):
        compile_parts(CompileSpec(mode="blocks", backend="eager"), [], [nn.Linear(2, 2)])


def test_train_compile_flags():
    """``autoplan train --compile``: a bad value is a TrainConfigError before anything starts;
    auto is per block on accelerators and eager on CPU."""
    with pytest.raises(TrainConfigError, match="--compile 'fast'"):
        TrainConfig(compile="fast").check()
    assert compile_spec(TrainConfig(), torch.device("cpu")).mode == "none"
    assert compile_spec(TrainConfig(), torch.device("meta")).mode == "blocks"
    spec = compile_spec(TrainConfig(compile="model", compile_backend="aot_eager"), torch.device("cpu"))
    assert (spec.mode, spec.backend) == ("model", "aot_eager")


def test_train_refuses_whole_model_inductor_on_several_ranks(monkeypatch):
    """Whole-model inductor under the trainer on several ranks is refused before any step (it stopped
    at its first step unable to resolve a process group); aot_eager and per-block stay allowed."""
    monkeypatch.setattr("autoplan.train.loop.dist.is_initialized", lambda: True)
    monkeypatch.setattr("autoplan.train.loop.dist.get_world_size", lambda *a, **k: 4)
    with pytest.raises(TrainConfigError, match="--compile model with --compile-backend inductor"):
        compile_spec(TrainConfig(compile="model"), torch.device("cpu"))
    assert compile_spec(TrainConfig(compile="blocks"), torch.device("cpu")).mode == "blocks"
    assert compile_spec(TrainConfig(compile="model", compile_backend="aot_eager"), torch.device("cpu")).mode == "model"
