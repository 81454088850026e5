"""Async TP priced from what the fused op does: a GEMM cut into tp chunks, each chunk's copy on a
side stream. Compute-bound, the collective hides and the price is the smaller GEMMs' efficiency;
copy-bound, what the chunks cannot cover stays. The planner prices a sequence-parallel plan so,
and only where the pass fuses."""
from __future__ import annotations

import pytest

from autoplan import MeshSpec, autoplan
from autoplan.errors import InvalidArgumentError
from autoplan.presets import build_preset
from cost_models.overlap import fused_collective_matmul


def test_fused_collective_matmul_hides_behind_compute_and_pays_for_its_chunks():
    # compute-bound: 8 chunks of 1.1 ms each (vs 8 ms whole) hide a 4 ms gather: 0.8 ms of chunk loss
    assert fused_collective_matmul(4e-3, 8e-3, 1.1e-3, 8) == pytest.approx(8 * 1.1e-3 - 8e-3)
    # copy-bound: 7 copies of 2 ms each; only the first chunk's GEMM is not covered by a copy
    assert fused_collective_matmul(14e-3, 4e-3, 0.5e-3, 8) == pytest.approx(0.5e-3 + 14e-3 - 4e-3)
    assert fused_collective_matmul(3e-3, 1e-3, 1e-3, 1) == 3e-3   # no tensor parallelism: nothing to fuse
    assert fused_collective_matmul(0.0, 8e-3, 1e-3, 8) == 0.0     # never negative


@pytest.fixture(scope="module")
def llama():
    return build_preset("titan-llama3-8b", num_layers=2)


def test_the_planner_prices_async_tp_only_where_the_pass_fuses(llama):
    mesh = MeshSpec((8,), ("tp",), "h100_sxm")
    kw = dict(batch=(8, 4096), allow_replicated_units=False)
    off = autoplan(llama, mesh, sequence_parallel=True, **kw)
    on = autoplan(llama, mesh, sequence_parallel=True, overlap="async_tp", **kw)
    assert on.predictions["overlap"] == "async_tp" and off.predictions["overlap"] == "none"
    assert on.predictions["step_s"] < off.predictions["step_s"]
    # the collectives still run (verify counts them): only their exposed time changed
    assert on.predictions["collectives"] == off.predictions["collectives"]
    # no sequence-parallel stream: all-reduces, which the pass does not fuse -- the same price
    r_off = autoplan(llama, mesh, sequence_parallel=False, **kw)
    r_on = autoplan(llama, mesh, sequence_parallel=False, overlap="async_tp", **kw)
    assert r_on.predictions["step_s"] == pytest.approx(r_off.predictions["step_s"])
    with pytest.raises(InvalidArgumentError, match="overlap='ring'"):
        autoplan(llama, mesh, overlap="ring", **kw)


class _Pairs:
    """A cost context that records which GEMMs each collective is priced beside."""

    def __init__(self):
        self.seen = []

    def collective_time(self, c):
        return 1.0

    def fused_tp_time(self, c, gemms, shard):
        self.seen.append((c.kind, c.phase, tuple(g[0] for g in gemms)))
        return 0.0 if gemms else 1.0


def _unit(*names_biased):
    """Weight GEMM entries in graph order: (flops as a name tag, M, N, K, split, biased)."""
    return [(name, 8, 8, 8, "n", biased) for name, biased in names_biased]


def test_collectives_pair_with_the_gemms_torchs_pass_fuses():
    from autoplan.search.pricing.async_tp import async_tp_exposed
    from hyper_parallel.core.collective import Collective

    own = [Collective("all_gather", "forward", 64), Collective("reduce_scatter", "forward", 64),
           Collective("all_gather", "backward", 64), Collective("reduce_scatter", "backward", 64)]
    attention = [("attn", 8, 8, 8, "causal", 0.5)]   # an attention entry is never a weight GEMM
    # Llama attention: q, k, v read the gathered stream, o makes the output; q/k/v gradients summed
    ctx = _Pairs()
    assert async_tp_exposed(ctx, _unit(("q", False), ("k", False), ("v", False)) + attention + _unit(("o", False)),
                            8, own, []) == (0.0, 1.0)
    assert ctx.seen == [("all_gather", "forward", ("q", "k", "v")), ("reduce_scatter", "forward", ("o",)),
                        ("all_gather", "backward", ("o",)), ("reduce_scatter", "backward", ())]
    # Phi-3's packed qkv: one GEMM makes the input gradient, so its reduce-scatter fuses too
    assert async_tp_exposed(_Pairs(), _unit(("qkv", False), ("o", False)), 8, own, []) == (0.0, 0.0)
    # biased projections (addmm: Qwen2's q/k/v, GPT-2's Conv1D) fuse nothing in the forward
    ctx = _Pairs()
    assert async_tp_exposed(ctx, _unit(("qkv", True), ("o", True)), 8, own, own[:2]) == (2.0, 2.0)
    assert ("all_gather", "forward", ()) in ctx.seen and ("reduce_scatter", "forward", ()) in ctx.seen
