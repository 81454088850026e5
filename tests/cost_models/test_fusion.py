"""Compiled pricing: the elementwise chains of a captured block fuse into one pass each, and the
planner prices a compiled plan faster than eager by exactly what the chains save."""
from __future__ import annotations

import pytest

from autoplan import MeshSpec, autoplan
from autoplan.capture import capture
from autoplan.errors import InvalidArgumentError
from autoplan.models.llama import build_llama
from autoplan.search.units.structure import model_structure
from cost_models.fusion import chain_passes, compile_mode, fuse


@pytest.fixture(scope="module")
def graph():
    model = build_llama(device="meta", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128,
                        max_seq_len=64)
    return capture(model, batch=(2, 64))


def test_block_chains_fuse_norms_rotary_and_gate(graph):
    fusion = fuse(graph.nodes, "blocks")
    by = {n.name: n for n in graph.nodes}
    ops = [{by[x].op.split(".")[1] for x in chain} for chain in fusion.chains]
    assert any({"rsqrt", "mean", "pow"} <= o for o in ops)           # a norm is one chain
    assert any({"silu", "mul"} <= o for o in ops)                    # SwiGLU's activation times its gate
    assert any({"sub", "stack"} <= o for o in ops)                   # rotary
    # no GEMM or attention inside a chain, and nothing outside the blocks under "blocks"
    assert all(not by[x].flops_fwd and by[x].block for chain in fusion.chains for x in chain)
    # fused traffic is below eager, and each chain is one kernel
    blocks = [n for n in graph.nodes if n.name in fusion.bytes]
    assert fusion.saved_bytes(blocks) > 0.5 * fusion.eager_bytes(blocks)
    assert sum(fusion.kernels.values()) == len(fusion.chains)


def test_norm_chain_reads_its_input_once_and_writes_its_output_once(graph):
    fusion = fuse(graph.nodes, "blocks")
    by = {n.name: n for n in graph.nodes}
    norm = next(c for c in fusion.chains if by[c[0]].module.endswith("attention_norm"))
    x = next(by[p] for p in by[norm[0]].input_nodes)       # the block's input (the embedding's output)
    out = by[norm[-1]].outputs[0]
    weight = 64 * 4
    assert sum(fusion.bytes[n] for n in norm) == pytest.approx(x.outputs[0].nbytes + out.nbytes + weight)


def test_no_chain_waits_on_a_gemm(graph):
    """The residual add after the attention projection is not fused with the norm before it."""
    fusion = fuse(graph.nodes, "blocks")
    by = {n.name: n for n in graph.nodes}
    for chain in fusion.chains:
        modules = {by[x].module for x in chain}
        assert not ({"layers.0.attention_norm", "layers.0.ffn_norm"} <= modules)


def test_scopes(graph):
    assert fuse(graph.nodes, "none").chains == []
    blocks, model = fuse(graph.nodes, "blocks"), fuse(graph.nodes, "model")
    by = {n.name: n for n in graph.nodes}
    outside = [x for c in model.chains for x in c if by[x].block is None]
    assert outside and not any(by[x].block is None for c in blocks.chains for x in c)   # the final norm too
    assert compile_mode(True) == "blocks" and compile_mode(False) == "none"
    with pytest.raises(ValueError, match="compile='fast'"):
        compile_mode("fast")
    assert chain_passes(1, 0) == 3


def test_compiled_structure_prices_fewer_bytes_and_kernels(graph):
    eager, comp = model_structure(graph), model_structure(graph, compile="blocks")
    e, c = eager.blocks[0], comp.blocks[0]
    assert c.mlp.work.other_bytes < e.mlp.work.other_bytes
    assert c.attention.work.kernels < e.attention.work.kernels and c.attention.work.fused_kernels > 0
    assert c.mlp.work.flops == e.mlp.work.flops and c.mlp.work.gemms == e.mlp.work.gemms
    whole = model_structure(graph, compile="model")
    assert whole.head.work.other_bytes < comp.head.work.other_bytes       # the loss: 3 passes, not 6


def test_plan_states_compile_and_is_faster_on_h100(graph):
    model = build_llama(device="meta", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128,
                        max_seq_len=64)
    mesh = MeshSpec((1, 2), ("dp", "tp"), "h100_sxm")
    eager = autoplan(model, mesh, batch=(2, 64), graph=graph)
    comp = autoplan(model, mesh, batch=(2, 64), graph=graph, compile=True)
    assert eager.predictions["compile"] == "none" and comp.predictions["compile"] == "blocks"
    assert comp.predictions["step_s"] < eager.predictions["step_s"]
    with pytest.raises(InvalidArgumentError, match="compile"):
        autoplan(model, mesh, batch=(2, 64), graph=graph, compile="yes")
