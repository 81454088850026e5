"""One rank raising inside a schedule makes every rank of the pipeline raise within seconds.

Issue 29: Nemotron's weight pass raised on ranks 2-3 at pp=2 x tp=2 and ranks 0-1 waited in their
P2P receives until the process group timed out. Now the failing rank flags the step in the store
and the waiting ranks poll it (failfast.py): they raise PipelinePeerFailedError naming it."""
import pytest

from tests.pipeline.workers import run_fail_fast

PROMPT_S = 10.0   # the pool's group timeout is 60 s: a rank that waited for it fails this


@pytest.mark.parametrize("fail_rank", [2])
def test_one_rank_failing_mid_schedule_fails_every_rank_promptly(fail_rank, pool4):
    results = pool4.run(run_fail_fast, fail_rank)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["error"] is not None, r
        assert r["failed_rank"] == fail_rank, r
        assert r["seconds"] < PROMPT_S, r
        if r["rank"] == fail_rank:
            assert r["error"] == "InjectedFailure" and any("peers were told" in n for n in r["notes"]), r
        else:
            assert r["error"] == "PipelinePeerFailedError", r
            assert f"global rank {fail_rank} failed" in r["message"] and "InjectedFailure" in r["message"], r
