"""Every schedule on 2 and 4 gloo ranks equals one device: loss and every gradient, for the repo
Llama and HF Llama, tied and untied embeddings. One pool call per world size runs all cases."""
import pytest

from tests.pipeline.workers import run_pure_pp

SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "ZeroBubble", "ZBV"]
MODELS = [("titan", False), ("titan", True), ("hf", False), ("hf", True)]


def _cases(p: int):
    # 2 micro-batches per rank; 6 blocks so that 2p stages (interleaved, ZBV at p=4) fit
    m = 2 * p
    return [(kind, tie, name, m, 6 if p == 4 else 4, m, 8) for kind, tie in MODELS for name in SCHEDULES]


def _check(results, n_cases):
    assert all(len(r) == n_cases for r in results)
    for i in range(n_cases):
        per_rank = [r[i] for r in results]
        case = per_rank[0]["case"]
        losses = [x for x in per_rank if x["loss_err"] is not None]
        assert len(losses) == 1, (case, "exactly one rank holds the last stage")
        assert losses[0]["loss_err"] < 1e-5, (case, losses[0])
        assert losses[0]["n_losses"] == case[3], case
        for x in per_rank:
            assert x["n_params"] > 0 and x["grad_err"] < 1e-4, (case, x)


@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_one_device(world, request):
    pool = request.getfixturevalue(f"pool{world}")
    cases = _cases(world)
    _check(pool.run(run_pure_pp, cases), len(cases))
