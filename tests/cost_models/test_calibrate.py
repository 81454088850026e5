"""Collective calibration: the fit recovers known alpha/beta; the benchmark runs on gloo ranks."""
import pandas as pd
import pytest

from cost_models.calibrate import bench_collectives, fit_alpha_beta, fit_collectives
from cost_models.collectives import collective_time
from cost_models.hardware import Link


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "send_recv", "all_to_all"])
def test_fit_recovers_alpha_and_bandwidth(kind):
    link = Link("true", bandwidth=3e9, latency=40e-6)
    sizes = [2 ** k for k in range(10, 24)]
    frame = pd.DataFrame({"kind": kind, "nbytes": sizes, "group_size": 4,
                          "time_s": [collective_time(kind, s, 4, link) for s in sizes]})
    alpha, bw = fit_alpha_beta(frame)
    assert alpha == pytest.approx(40e-6, rel=1e-6) and bw == pytest.approx(3e9, rel=1e-6)
    fits, points = fit_collectives(frame)
    assert fits.loc[0, "heldout_mape"] == pytest.approx(0.0, abs=1e-9)
    assert points["held_out"].sum() == len(sizes) // 2


def test_benchmark_runs_every_kind_on_two_gloo_ranks(pool2):
    kinds = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
    per_rank = pool2.run(bench_collectives, kinds, [1024, 65536], 2, 1, 1)
    assert per_rank[0] == per_rank[1]  # the slowest rank's time is agreed on by all
    frame = pd.DataFrame(per_rank[0])
    assert sorted(frame["kind"].unique()) == sorted(kinds)
    assert (frame["error"] == "").all(), frame["error"].tolist()
    assert (frame["time_s"] > 0).all() and set(frame["nbytes"]) == {1024, 65536}
