"""Context parallelism composed with pipeline parallelism: pp=2 x cp=2 on 4 gloo
ranks, the repo Llama, a transformers Llama and Qwen3 (q/k norms), ring and all-gather attention, GPipe and 1F1B --
loss and every gradient equal one device."""
from tests.pipeline.cp_pipeline_workers import run_cp_pipeline

CASES = [("titan", "1F1B", 2, "ring"), ("titan", "GPipe", 2, "allgather"),
         ("hf", "1F1B", 2, "ring"), ("hf", "GPipe", 2, "allgather"), ("qwen3", "1F1B", 2, "ring")]


def test_pp2_cp2_equals_one_device(pool4):
    for rank, results in enumerate(pool4.run(run_cp_pipeline, CASES)):
        for r in results:
            assert r["n_params"] > 0, (rank, r)
            assert r["grad_err"] < 1e-4, (rank, r)
            if r["loss_err"] is not None:
                assert r["loss_err"] < 1e-5, (rank, r)
