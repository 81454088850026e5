"""Each style on its own: one-device numerics, collective counts, and parity with torch's styles."""
import pytest

from tests.runtime import style_workers
from tests.runtime.style_cases import CASES, TORCH_CANNOT


@pytest.mark.parametrize("world", [2, 4])
def test_each_style_matches_one_device_counts_and_torch(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    reports = pool.run(style_workers.check_styles)
    for rank, report in enumerate(reports):
        assert set(report) == set(CASES)
        for name, r in report.items():
            where = f"world {world} rank {rank} case {name}"
            assert r["out_ok"], f"{where}: output differs from one device"
            assert r["grad_bad"] == [], f"{where}: gradients differ: {r['grad_bad']}"
            assert r["counts"] == r["expected"], f"{where}: collectives {r['counts']} != {r['expected']}"
            assert r["dtensor_params"], f"{where}: no parameter became a DTensor"
            if name in TORCH_CANNOT:
                continue
            # torch's styles: same numbers, same forward collectives
            assert r["torch_out_same"], f"{where}: torch's styles give other outputs"
            assert r["torch_grad_diff"] == [], f"{where}: torch's styles give other grads {r['torch_grad_diff']}"
            assert r["torch_forward_counts"] == {k: v[0] for k, v in r["counts"].items()}, where
            # backward: identical except, with reduce_grads=True, our one all-reduce per replicated
            # parameter whose gradient DTensor leaves Partial (torch defers it to the optimizer)
            for fqn, (fwd, bwd) in r["counts"].items():
                theirs = dict(r["torch_backward_counts"][fqn])
                if name == "sequence_parallel_norm_reduced" and fqn in ("", "norm"):
                    theirs["all_reduce"] = theirs.get("all_reduce", 0) + 1
                assert bwd == theirs, f"{where} {fqn}: backward {bwd} vs torch {theirs}"
