"""Importable model factories and rank functions for the measured-mode tests and benchmarks."""
from __future__ import annotations

from autoplan.models import build_llama

TINY = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=128, ffn_hidden=128, max_seq_len=32)


def tiny_llama(seed: int = 3, **overrides):
    """Deterministic small Llama on CPU (two calls give equal weights)."""
    return build_llama(seed=seed, **dict(TINY, **overrides))


def measure_without_pool(plan_json: str, **kw):
    """Rank function: :func:`autoplan.verify.measured.measure` on the already-initialised default
    group (the torchrun path), with the factory given as a 'module:function' string."""
    from autoplan.verify.measured import measure

    frame = measure(plan_json, "tests.verify.measured_workers:tiny_llama", **kw)
    return frame.to_dict("records")
