"""Measured mode on gloo ranks: numerics vs one device, per-rank step time and memory vs predicted.

No timing asserts (the host is shared): times are only checked to be positive and finite.
"""
from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from autoplan import MeshSpec, autoplan
from autoplan.models import build_llama
from autoplan.verify.measured import COLUMNS, measure, resolve_factory, summarize
from hyper_parallel.errors import DistributedRunError
from tests.verify.measured_workers import TINY, measure_without_pool, tiny_llama


def _plan(shape, names, batch=(4, 16), **kw):
    model = build_llama(device="meta", **TINY)
    return autoplan(model, MeshSpec(shape, names, "cpu"), batch=batch, dtype=torch.float32, **kw)


def _check_frame(frame, world):
    assert list(frame.columns) == list(COLUMNS)
    assert sorted(frame["rank"]) == list(range(world))
    assert frame["numerics_ok"].all(), frame[["rank", "loss_rel_err", "grad_mismatches"]]
    assert (frame["loss_rel_err"] <= 1e-5).all()
    assert (frame["grads_checked"] > 0).all()
    step = frame["measured_step_s"]
    assert ((step > 0) & step.map(math.isfinite)).all()
    assert step.nunique() == 1  # the slowest rank's time, agreed by all ranks
    assert (frame["predicted_step_s"] > 0).all()
    assert (frame["measured_activation_bytes"] > 0).all()
    assert frame["memory_source"].iloc[0] == "state+saved_activations"


def test_tp2_sharded_matches_one_device(pool2):
    plan = _plan((2,), ("tp",), allow_replicated_units=False)
    frame = measure(plan, tiny_llama, pool=pool2, steps=2, warmup=1)
    _check_frame(frame, 2)
    # parameters, gradients and AdamW state held per rank: exactly what the plan predicts
    assert (frame["measured_static_bytes"] == frame["predicted_static_bytes"]).all()
    s = summarize(frame)
    assert s["world"] == 2 and s["numerics_ok"]


def test_dp2_tp2_sequence_parallel_fsdp(pool4):
    plan = _plan((2, 2), ("dp", "tp"), allow_replicated_units=False, sequence_parallel=True)
    assert plan.stream_layout == "S" and plan.fsdp["enabled"]
    frame = measure(plan, tiny_llama, pool=pool4, steps=2, warmup=1)
    _check_frame(frame, 4)
    rel = (frame["measured_static_bytes"] - frame["predicted_static_bytes"]).abs() / frame["predicted_static_bytes"]
    assert (rel < 0.05).all(), frame[["rank", "measured_static_bytes", "predicted_static_bytes"]]


def test_default_group_path_and_string_factory(pool2):
    """The torchrun path: no pool, the default process group, factory as 'module:function'."""
    plan = _plan((2,), ("tp",), allow_replicated_units=False)
    per_rank = pool2.run(measure_without_pool, plan.to_json(), steps=1, warmup=0, numerics=False)
    assert pd.DataFrame(per_rank[0]).equals(pd.DataFrame(per_rank[1]))  # every rank gets the whole frame
    rows = per_rank[0]
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["numerics_ok"] is None for r in rows)
    assert all(r["measured_step_s"] > 0 for r in rows)


def test_world_mismatch_fails_loudly(pool2):
    plan = _plan((4,), ("tp",), allow_replicated_units=False)
    with pytest.raises(DistributedRunError, match="needs 4 ranks"):
        measure(plan, tiny_llama, pool=pool2, steps=1)


def test_resolve_factory():
    assert resolve_factory("tests.verify.measured_workers:tiny_llama") is tiny_llama
    assert resolve_factory(tiny_llama) is tiny_llama
    with pytest.raises(ValueError, match="module:function"):
        resolve_factory("tests.verify.measured_workers")
