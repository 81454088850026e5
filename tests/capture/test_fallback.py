"""Models export cannot trace are captured at module level, with a warning naming the part."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from autoplan.capture import capture
from autoplan.capture.views import module_summary
from autoplan.errors import CaptureError

B, D, H = 4, 8, 16


class Branchy(nn.Module):
    """Picks a layer from the value of its activations: data-dependent control flow."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, H)
        self.b = nn.Linear(H, H)
        self.c = nn.Linear(H, H)
        self.out = nn.Linear(H, D)

    def forward(self, x):
        h = self.a(x)
        h = self.b(h) if h.mean() > 0 else self.c(h)
        return self.out(h)


class Net(nn.Module):
    def __init__(self, n: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(Branchy() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_data_dependent_model_falls_back_to_hooks(caplog):
    with caplog.at_level(logging.WARNING, logger="autoplan.capture"):
        g = capture(Net(), torch.randn(B, D))
    assert g.method == "hooks"
    warned = [r.getMessage() for r in caplog.records if "module level" in r.getMessage()]
    assert warned and "'layers.0'" in warned[0]
    assert [(b.prefix, b.count) for b in g.blocks] == [("layers", 2)]
    # meta cannot evaluate the condition; the branch taken is `c` (the condition read as 0)
    modules = [n.module for n in g.nodes]
    assert "layers.0.c" in modules and "layers.0.b" not in modules
    per_layer = 2 * B * D * H + 2 * B * H * H + 2 * B * H * D
    assert g.total_flops() == 2 * per_layer
    assert g.num_parameters == sum(p.numel() for p in Net().parameters())
    # only the module that read a value stays a module-level node; its children are exported
    by_module = {n.module: n for n in g.nodes}
    assert by_module["layers.0"].op.startswith("module:")
    assert by_module["layers.0.c"].op == "aten.linear.default"
    assert by_module["layers.0.c"].input_nodes[0] == by_module["layers.0.a"].name
    assert by_module["layers.0.c"].params == ["layers.0.c.bias", "layers.0.c.weight"]
    assert module_summary(g).set_index("fqn").loc["layers.0", "count"] == 2


def test_fallback_can_be_refused():
    with pytest.raises(CaptureError, match="failed"):
        capture(Net(), torch.randn(B, D), fallback=False)


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(D, D)

    def forward(self, x):
        return self.inner(x) @ torch.ones(3, 3, device=x.device)  # wrong shapes: fails eagerly too


def test_model_that_does_not_run_names_the_module():
    with pytest.raises(CaptureError, match="Broken"):
        capture(Broken(), torch.randn(B, D))


class MakesCpuTensors(nn.Module):
    """Creates a tensor without a device in forward: runs on CPU, not on meta."""

    def __init__(self, branchy: bool = False):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.branchy = branchy

    def forward(self, x):
        h = self.a(x) + torch.ones(D)
        if self.branchy and h.sum() > 0:
            h = h * 2
        return h


def test_forward_creating_cpu_tensors_is_exported_with_fake_tensors():
    with torch.device("meta"):
        model = MakesCpuTensors()
    g = capture(model, torch.empty(B, D, device="meta"))
    assert g.method == "export-fake"
    assert g.total_flops() == 2 * B * D * D
    assert model.a.weight.device.type == "meta"  # parameters given back


def test_hooks_fall_back_to_fake_tensors_too():
    g = capture(MakesCpuTensors(branchy=True), torch.randn(B, D))
    assert g.method == "hooks"
    assert g.total_flops() == 2 * B * D * D
    assert any(n.op == "aten.linear.default" and n.module == "a" for n in g.nodes)
