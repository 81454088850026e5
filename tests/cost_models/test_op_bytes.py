"""What an eager op moves is what its kernels read and write: a dtype cast copies, a view per torch's
schema is free, and a real copy is priced whatever its name looks like (``index_select`` is no
``select``, ``cat.default`` no transpose). torchtitan's complex rotary stays eager kernels compiled."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autoplan.capture import capture
from autoplan.models.llama import build_llama
from autoplan.search.units.work import _op_classes
from cost_models.fusion import EAGER, fuse, moves_nothing

N = 2 * 8 * 16   # elements of the (2, 8, 16) activation


class Casts(nn.Module):
    """RMSNorm's pattern: a bf16 activation copied to fp32 and back, plus pure views."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        h = self.w(x)
        up = h.float()                               # a cast: reads 2 B, writes 4 B per element
        same = up.float()                            # already fp32: returns its input, moves nothing
        down = (same * 2).type_as(h)                 # reads the fp32 input only, not ``h`` (its dtype)
        return down.transpose(1, 2).reshape(2, -1)   # views


class Copies(nn.Module):
    """Ops an old name test called views: index_select, cat, rsqrt, an explicit _to_copy."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16, bias=False)
        self.register_buffer("idx", torch.arange(4), persistent=False)

    def forward(self, x):
        h = self.w(x)
        picked = h.index_select(1, self.idx)
        both = torch.cat([picked, picked], dim=1)
        return torch.rsqrt(both.abs() + 1).to(torch.float32, copy=True).select(1, 0)


def _nodes(module, dtype=torch.bfloat16):
    return capture(module.to("meta"), (torch.empty(2, 8, 16, device="meta"),), dtype=dtype).nodes


def _by_op(nodes):
    out: dict[str, list] = {}
    for n in nodes:
        out.setdefault(n.op.split(".")[1] if n.op.count(".") else n.op, []).append(n)
    return out


def test_a_cast_reads_and_writes_the_tensor_a_noop_cast_and_views_move_nothing():
    ops = _by_op(_nodes(Casts()))
    up, same = ops["to"]
    assert (up.bytes_read, up.bytes_written) == (2 * N, 4 * N)
    assert (same.bytes_read, same.bytes_written) == (0, 0) and moves_nothing(same)
    (down,) = ops["type_as"]
    assert (down.bytes_read, down.bytes_written) == (4 * N, 2 * N)
    for name in ("transpose", "reshape"):
        assert all(moves_nothing(n) for n in ops[name])
    # in fp32 the same model casts nothing
    fp32 = _by_op(_nodes(Casts(), dtype=torch.float32))
    assert all(n.bytes_read == n.bytes_written == 0 for n in fp32["to"] + fp32["type_as"])


def test_real_copies_are_priced_and_launch_kernels():
    nodes = _nodes(Copies())
    ops = _by_op(nodes)
    copies = [n for name in ("index_select", "cat", "rsqrt", "to", "_to_copy") for n in ops.get(name, [])]
    assert {n.op.split(".")[1] for n in copies} >= {"index_select", "cat", "rsqrt"}
    assert all(n.bytes_read and n.bytes_written and not moves_nothing(n) for n in copies)
    _, other = _op_classes(nodes)
    priced = [n for n in nodes if not n.flops_fwd and not moves_nothing(n)]
    assert {n.name for n in copies} <= {n.name for n in priced}
    assert other == pytest.approx(3.0 * sum(n.bytes_read + n.bytes_written for n in priced))
    kernels, fused = EAGER.kernels_of(nodes)
    assert fused == 0 and kernels == 3 * len([n for n in nodes if not moves_nothing(n)])
    assert all(moves_nothing(n) for n in ops["select"])


def _llama(rope_complex):
    return build_llama(device="meta", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128,
                       max_seq_len=64, rope_complex=rope_complex)


def test_complex_rope_is_the_same_rotation():
    real = build_llama(seed=3, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128,
                       max_seq_len=16)
    cplx = build_llama(seed=3, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=128,
                       max_seq_len=16, rope_complex=True)
    tokens = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(real(tokens), cplx(tokens), rtol=1e-5, atol=1e-5)


def test_compiled_complex_rope_keeps_its_multiply_eager_and_its_casts():
    """Inductor generates no complex code: the rotary multiply stays an eager kernel, and the casts
    on either side are kernels of their own, so compiled it saves far less than the real rotary."""
    saved = {}
    for rope_complex in (False, True):
        graph = capture(_llama(rope_complex), batch=(2, 64), dtype=torch.bfloat16)
        fusion = fuse(graph.nodes, "blocks")
        rotary = [n for n in graph.nodes if n.module == "layers.0.attention" and not n.flops_fwd]
        casts = [n for n in rotary if n.op == "aten.to.dtype"]
        assert len(casts) == 2 and all(n.bytes_written == 2 * n.bytes_read for n in casts)   # bf16 -> fp32
        complex_muls = [n for n in rotary if n.op == "aten.mul.Tensor" and "complex" in n.outputs[0].dtype]
        assert bool(complex_muls) == rope_complex
        assert not any(fusion.fused(n.name) for n in complex_muls)
        saved[rope_complex] = fusion.saved_bytes(rotary)
    assert 0 < saved[True] < 0.5 * saved[False]
