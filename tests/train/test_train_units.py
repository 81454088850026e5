"""The training driver's pieces without ranks: launch lines, data streams, schedule, progress, metrics."""
from __future__ import annotations

import io
import json
import logging
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist

from autoplan.cli import main
from autoplan.plan import Plan
from autoplan.train import TrainConfig, torchrun_command
from autoplan.train.data import token_stream
from autoplan.train.errors import DataError, TrainConfigError
from autoplan.train.launch import format_command
from autoplan.train.loop import lr_at
from autoplan.train.metrics import MetricsWriter
from autoplan.train.model import build_model, flops_per_token
from autoplan.train.plan_source import plan_for
from autoplan.train.progress import Progress
from tests.train import train_workers


def _plan(shape=(2, 1, 4), per_node=4) -> Plan:
    from autoplan import MeshSpec, autoplan

    model = build_model("titan-llama-debug", device="meta")
    plan = autoplan(model, MeshSpec((shape[0] * shape[1], shape[2]), ("dp", "tp"), "cpu", per_node), batch=(8, 32),
                    dtype=torch.float32)
    data = plan.to_dict()
    data["mesh"] = {"shape": list(shape), "names": ["dp", "pp", "tp"], "hardware": "cpu", "devices_per_node": per_node}
    return Plan.from_dict(data)


@pytest.fixture(scope="module")
def plan_8():
    return _plan()


def test_launch_one_node_and_many_nodes(plan_8, tmp_path):
    one = torchrun_command(plan_8, nproc_per_node=8, plan_path="p.json", train_args=["--steps", "5"])
    assert one == ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "8", "-m", "autoplan.cli",
                   "train", "--plan", "p.json", "--steps", "5"]
    many = torchrun_command(plan_8, rdzv_endpoint="node0:29500", job_id="j1")  # devices_per_node 4 -> 2 nodes
    assert many[:11] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", "node0:29500", "--rdzv-id", "j1"]
    assert format_command(torchrun_command(plan_8)).count("$MASTER_ADDR:29500") == 1
    with pytest.raises(TrainConfigError, match="does not divide"):
        torchrun_command(plan_8, nproc_per_node=3)
    path = tmp_path / "p.json"
    plan_8.to_json(path)
    assert main(["launch", str(path), "--nnodes", "2", "--", "--steps", "100"]) == 0


def test_launch_cli_prints_the_line(plan_8, tmp_path, capsys):
    path = tmp_path / "p.json"
    plan_8.to_json(path)
    assert main(["launch", str(path), "--rdzv-endpoint", "head:29400", "--", "--steps", "100"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint head:29400 "
                      f"--rdzv-id autoplan -m autoplan.cli train --plan {path} --steps 100")
    assert "each of the 2 nodes" in out[1]


def test_synthetic_stream_is_a_function_of_position():
    a = token_stream("synthetic", batch=4, seq=16, vocab=256, seed=3)
    first = [a.next() for _ in range(3)]
    b = token_stream("synthetic", batch=4, seq=16, vocab=256, seed=3)
    b.restore({"position": 2})
    x, y = b.next()
    assert torch.equal(x, first[2][0]) and torch.equal(y, first[2][1])
    assert torch.equal(first[0][0][:, 1:], first[0][1][:, :-1]) and int(first[0][0].max()) < 256
    assert not torch.equal(first[0][0], first[1][0])


def test_file_streams(tmp_path):
    ids = np.arange(100, dtype=np.uint16) % 50
    np.save(tmp_path / "t.npy", ids)
    ids.tofile(tmp_path / "t.bin")
    for name in ("t.npy", "t.bin"):
        s = token_stream(str(tmp_path / name), batch=2, seq=9, vocab=50)  # 20 tokens a batch, 5 per epoch
        windows = [s.next()[0] for _ in range(6)]
        assert windows[0].tolist() == [list(range(0, 9)), list(range(10, 19))]
        assert torch.equal(windows[5], windows[0])  # wrapped around
        assert s.state() == {"position": 6}
    (tmp_path / "t.txt").write_text("hello world " * 10)
    x, y = token_stream(str(tmp_path / "t.txt"), batch=2, seq=8, vocab=256).next()
    assert bytes(x[0].tolist()).decode() == "hello wo" and y[0, 0] == ord("e")
    with pytest.raises(DataError, match="one batch needs"):
        token_stream(str(tmp_path / "t.npy"), batch=8, seq=32, vocab=50)
    with pytest.raises(DataError, match="vocabulary"):
        token_stream(str(tmp_path / "t.npy"), batch=2, seq=9, vocab=10)
    with pytest.raises(DataError, match="no such file"):
        token_stream(str(tmp_path / "missing.npy"), batch=2, seq=9, vocab=10)


def test_lr_schedules():
    cfg = TrainConfig(lr=1.0, min_lr=0.1, warmup=2, steps=12, schedule="cosine")
    assert [lr_at(cfg, s) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(cfg, 2) == pytest.approx(1.0) and lr_at(cfg, 12) == pytest.approx(0.1)
    assert lr_at(TrainConfig(lr=1.0, steps=10, schedule="linear"), 5) == pytest.approx(0.5)
    with pytest.raises(TrainConfigError, match="--schedule"):
        lr_at(TrainConfig(schedule="step"), 3)


def test_models_from_presets_hf_names_and_config_json(tmp_path):
    a = build_model("titan-llama-debug", seed=1)
    b = build_model("titan-llama-debug", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert flops_per_token(a, 32) == 6 * (sum(p.numel() for p in a.parameters()) - 256 * 128) + 12 * 4 * 8 * 16 * 32
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128)
    hf = build_model("hf:llama", overrides=small)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.vocab_size == 128
    (tmp_path / "config.json").write_text(json.dumps(dict(small, model_type="qwen2")))
    assert type(build_model(str(tmp_path / "config.json"), layers=1)).__name__ == "Qwen2ForCausalLM"
    with pytest.raises(TrainConfigError, match="unknown preset"):
        build_model("no-such-model")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _row(step):
    return {"step": step, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": 0.1, "memory_gib": 1.0,
            "memory_kind": "rss"}


def test_progress_rich_on_a_tty_log_lines_otherwise(caplog):
    tty = _Tty()
    p = Progress("auto", total=3, start=0, rank=0, stream=tty)
    assert p.mode == "rich"
    for s in (1, 2, 3):
        p.update(_row(s))
    p.close()
    assert "step     3 | loss 2.50000" in tty.getvalue() and "\x1b[" in tty.getvalue()  # live, with escapes
    pipe = io.StringIO()
    with caplog.at_level(logging.INFO, logger="autoplan.train"):
        p = Progress("auto", total=3, start=0, rank=0, log_every=2, stream=pipe)
        for s in (1, 2, 3):
            p.update(dict(_row(s), last=s == 3))
        p.close()
    assert p.mode == "log" and pipe.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split("|")[0].strip() for line in lines] == ["step     2", "step     3"]
    assert "mfu 10.00%" in lines[0]
    assert Progress("auto", total=3, start=0, rank=1, stream=tty).mode == "none"


def test_metrics_files(tmp_path):
    for name in ("m.csv", "m.jsonl", "m.json"):
        w = MetricsWriter(tmp_path / name)
        w.write(_row(1))
        w.write(_row(2))
        w.close()
    assert (tmp_path / "m.csv").read_text().splitlines()[0].startswith("step,loss,lr")
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2
    assert [r["step"] for r in json.loads((tmp_path / "m.json").read_text())] == [1, 2]
    w = MetricsWriter(tmp_path / "m.csv", append=True)  # a resumed run appends, no second header
    w.write(_row(3))
    w.close()
    assert len((tmp_path / "m.csv").read_text().splitlines()) == 4


def test_check_compatible_names_the_first_mismatch(tmp_path):
    import torch.distributed.checkpoint as dcp

    from autoplan.train.checkpoint import check_compatible
    from autoplan.train.errors import CheckpointMismatchError

    saved = build_model("titan-llama-debug", layers=2)
    dcp.save({"model": saved.state_dict()}, checkpoint_id=str(tmp_path / "c"))
    check_compatible(build_model("titan-llama-debug", layers=2, seed=3), tmp_path / "c")  # same shapes: fine
    cases = [(dict(layers=3), "layers.2.attention_norm.weight", "not in the checkpoint"),
             (dict(layers=1), "layers.1.attention_norm.weight", "of the checkpoint is not in the model"),
             (dict(layers=2, overrides={"vocab_size": 300}), "tok_embeddings.weight", "(256, 128) in the checkpoint")]
    for kwargs, name, text in cases:
        with pytest.raises(CheckpointMismatchError, match=re.escape(text)) as err:
            check_compatible(build_model("titan-llama-debug", **kwargs), tmp_path / "c")
        assert err.value.name == name


def test_every_rank_of_a_started_job_plans_the_offline_plan_and_disagreement_is_an_error(pool2):
    """plan_for inside a job: each rank plans itself (strategy checks included: the probe's fake
    group runs in a world of its own) and gets the plan planned with no process group."""
    # h100_sxm: the "cpu" profile scales with torch.get_num_threads(), which the pool's ranks set to 1
    kwargs = dict(model="titan-llama-debug", constraints={"tp": 2}, shard_all=True, hardware="h100_sxm", batch=8,
                  seq=32)
    assert not dist.is_initialized()
    offline = plan_for(TrainConfig(**kwargs), 2, torch.device("cpu"))
    offline = offline.replace(model=dict(offline.model, source=kwargs["model"]))
    assert offline.styles, offline
    for got in pool2.run(train_workers.plan_in_job, kwargs):
        assert got["plan"] == offline.to_json()
        assert "the ranks planned different plans" in got["error"] and "[0]" in got["error"], got["error"]
    # a plan made before the group was up (the Trainer's path under torchrun) or given is checked too
    for got in pool2.run(train_workers.trainer_with_rank_plans, kwargs):
        assert got["error"] is not None and "the ranks planned different plans" in got["error"], got
