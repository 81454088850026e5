"""The IR of a small hand-written model against FLOPs and bytes computed by hand."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from autoplan.capture import ModelGraph, capture
from autoplan.capture.views import block_dataflow, distinct_ops, module_summary

B, D, H, L = 4, 8, 16, 3  # batch, width, hidden, blocks
F32 = 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, D, bias=False)
        self.blocks = nn.ModuleList(Block() for _ in range(L))

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return h


@pytest.fixture(scope="module")
def graph() -> ModelGraph:
    with torch.device("meta"):
        model = Tiny()
    return capture(model, torch.empty(B, D, device="meta"))


def test_blocks_found_and_traced_once(graph):
    assert graph.method == "export"
    assert [(b.prefix, b.count, b.representative) for b in graph.blocks] == [("blocks", L, "blocks.0")]
    assert {n.module for n in graph.nodes if n.block} <= {"blocks.0", "blocks.0.up", "blocks.0.down"}


def test_forward_and_backward_flops_by_hand(graph):
    stem = 2 * B * D * D
    block = 2 * B * D * H + 2 * B * H * D
    assert graph.total_flops() == stem + L * block
    # stem: its input needs no grad, so only the weight gradient; blocks: grad input + grad weight
    assert graph.total_flops(backward=True) == stem + L * 2 * block


def test_bytes_by_hand(graph):
    up = next(n for n in graph.nodes if n.module == "blocks.0.up")
    assert up.bytes_read == (B * D + H * D) * F32
    assert up.bytes_written == B * H * F32
    relu = next(n for n in graph.nodes if n.op == "aten.relu.default")
    assert (relu.bytes_read, relu.bytes_written) == (B * H * F32, B * H * F32)
    read, written = graph.total_bytes()
    # up reads x and W, relu reads h, down reads h and W, the residual add reads two (B, D)
    per_block = ((B * D + H * D) + B * H + (B * H + D * H) + 2 * B * D) * F32
    assert read == (B * D + D * D) * F32 + L * per_block
    assert written == B * D * F32 + L * (B * H * F32 * 2 + B * D * F32 * 2)


def test_saved_for_backward_and_params(graph):
    up = next(n for n in graph.nodes if n.module == "blocks.0.up")
    relu = next(n for n in graph.nodes if n.op == "aten.relu.default")
    assert up.params == ["blocks.0.up.weight"]
    assert relu.saved_for_backward  # relu keeps its result, down keeps its input: the same tensor
    summary = module_summary(graph).set_index("fqn")
    assert summary.loc["blocks.0.down", "saved_bytes"] == B * H * F32
    assert summary.loc["blocks.0", "count"] == L
    assert summary.loc["blocks.0", "flops_fwd"] == 2 * B * D * H * 2
    assert summary.loc["blocks.0.up", "input_shapes"] == [(B, D)]
    assert summary.loc["blocks.0.up", "output_shapes"] == [(B, H)]
    assert graph.num_parameters == D * D + L * 2 * D * H == graph.traced_parameters()


def test_distinct_ops_replay_on_cpu(graph):
    ops = distinct_ops(graph)
    linears = [o for o in ops if o.op == "aten.linear.default"]
    assert sorted(o.count for o in linears) == [1, L, L]
    up = next(o for o in linears if o.inputs[1].shape == (H, D))
    out = up.run("cpu")
    assert out.shape == (B, H) and out.device.type == "cpu"
    assert sum(o.count for o in ops) == sum(graph.multiplicity(n) for n in graph.nodes if n.op != "getitem")


def test_dataflow_and_json_round_trip(graph):
    steps = block_dataflow(graph, "blocks")
    kinds = [(s.kind, s.role or s.op) for s in steps]
    assert kinds[0][0] == "module" and steps[0].name == "blocks.0.up"
    assert ("op", "aten.relu.default") in kinds and ("op", "aten.add.Tensor") in kinds
    add = next(s for s in steps if s.op == "aten.add.Tensor")
    assert any(i.startswith("block_input:") for i in add.inputs)  # the residual
    blob = json.dumps(graph.to_dict())
    again = ModelGraph.from_dict(json.loads(blob))
    assert again.total_flops() == graph.total_flops() and len(again.nodes) == len(graph.nodes)


def test_measured_op_costs_are_kept_across_captures(monkeypatch):
    """Op costs are measured once per process for a key of pure data (op, arguments, input metas,
    which inputs need grad, which are parameters): a second capture of the model measures nothing
    and gives the same graph; a new shape is measured."""
    import autoplan.capture.trace as trace

    model = Tiny()
    first = capture(model, torch.randn(B, D))
    calls = []
    real = trace.measure
    monkeypatch.setattr(trace, "measure", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    second = capture(model, torch.randn(B, D))
    assert calls == []
    assert json.dumps(second.to_dict(), sort_keys=True, default=str) == \
        json.dumps(first.to_dict(), sort_keys=True, default=str)
    capture(model, torch.randn(B + 1, D))
    assert calls, "a new batch size reuses costs measured at another shape"
