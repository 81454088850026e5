"""A checkpoint from elsewhere never runs code: loading is data-only, and a file that is not what a
checkpoint's file must be is refused, typed, on every rank, before anything is loaded.

The attack: a real checkpoint written by the Trainer, one of its pickled or torch-saved files
(``.metadata``, ``rng.pt``, each ``__<rank>_<n>.distcp`` shard, or only the non-tensor items inside
a shard, which torch's own DCP reader loads with ``weights_only=False``) replaced by a payload
that creates a marker file when unpickled, and the manifest recomputed (it is a checksum). Under
every plan kind the trainer writes -- one device, dp x tp with FSDP, pp x tp, ep -- resuming must
end in CheckpointUntrustedError naming the file, the same on every rank, with the model untouched
and no marker; so must ``autoplan train`` (``--resume`` auto, latest, step-N), ``autoplan
export-hf`` and ``consolidated``. With a checkpoint key, a checkpoint not signed with it is refused
by name before any of its files is read. (The scan for unguarded loads: test_guarded_loads.py.)
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoplan import plan_cluster
from autoplan.cli import main
from autoplan.train import CheckpointUntrustedError, TrainConfig, TrainConfigError, Trainer, checkpoint_key, manifest
from autoplan.train.checkpoint import consolidated
from autoplan.train.model import build_model
from tests.train import tamper, untrusted_workers

TITAN = dict(model="titan-llama-debug", batch=8, seq=32, lr=2e-3, progress="none")
MIXTRAL = dict(model="hf:mixtral", batch=8, seq=16, lr=2e-3, progress="none", mixed_precision="fp32",
               model_args=dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64))
PLANS = {"dp2tp2-fsdp": (TITAN, dict(dp=2, tp=2, pp=1, fsdp=True)), "pp2tp2": (TITAN, dict(dp=1, pp=2, tp=2)),
         "ep4": (MIXTRAL, dict(ep=4, pp=1, expert_parallel=True))}


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, dict]:
    """Each plan kind's TrainConfig settings (a plan file for 4 ranks; the dense ones shard every
    unit, the MoE one keeps its tiny attention whole under ep)."""
    d = tmp_path_factory.mktemp("untrusted-plans")
    out = {}
    for name, (base, cons) in PLANS.items():
        meta = build_model(base["model"], overrides=base.get("model_args"), device="meta")
        plan = plan_cluster(meta, 4, hardware="cpu", batch=(base["batch"], base["seq"]), devices_per_node=4,
                            constraints=cons, allow_replicated_units=name == "ep4", dtype=torch.float32)
        plan = plan.replace(model=dict(plan.model, source=base["model"]))
        plan.to_json(d / f"{name}.json")
        out[name] = dict(base, plan=str(d / f"{name}.json"))
    return out


def _refused_everywhere(res: dict, marker: Path) -> None:
    assert not res["marker"] and not marker.exists(), "code from the checkpoint ran"
    assert len(res["cases"]) == len(res["files"]) + 2
    for label, case in res["cases"].items():
        assert case["error"] == "CheckpointUntrustedError", (label, case)
        assert case["file"] == case["expected"], (label, case)
        assert f"file {case['file']}:" in case["message"] and "\n" not in case["message"], (label, case)
    partial = res["seen by some ranks"]
    assert partial["error"] == "CheckpointMismatchError" and partial["expected"] in partial["message"], partial
    assert res["untouched"], "a refused checkpoint changed the model or optimizer"
    assert res["clean"]["error"] is None and res["step"] == 2, res["clean"]


@pytest.mark.parametrize("kind", list(PLANS))
def test_tampered_files_are_refused_on_every_rank(kind, plans, pool4, tmp_path):
    marker = tmp_path / "marker"
    results = pool4.run(untrusted_workers.refusals, str(tmp_path / "ckpt"), plans[kind], str(marker))
    for rank, other in enumerate(results[1:], 1):
        assert other == results[0], (rank, other)   # the same verdict everywhere: no rank goes on alone
    res = results[0]
    assert {".metadata", "rng.pt", "__0_0.distcp", "__3_0.distcp"} <= set(res["files"])
    _refused_everywhere(res, marker)


def _one_error_line(capsys, *names: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert "Traceback" not in err and len(lines) == 1, err[-2000:]
    assert all(n in lines[0] for n in names), lines[0]
    return lines[0]


def test_one_device_cli_export_and_readers(world_of_one, tmp_path, capsys):
    marker = tmp_path / "marker"
    res = untrusted_workers.refusals(str(tmp_path / "ckpt"), TITAN, str(marker))
    assert res["files"] == [".metadata", "__0_0.distcp", "rng.pt"]
    _refused_everywhere(res, marker)

    ck = tmp_path / "ckpt" / "step-2"
    saved = tamper.snapshot(ck)
    train = ["train", "--model", "titan-llama-debug", "--steps", "4", "--checkpoint-dir", str(tmp_path / "ckpt"),
             "--progress", "none"]
    for tampering, file in ((lambda: tamper.as_pickle(ck, ".metadata", marker), ".metadata"),
                            (lambda: tamper.poison_byte_items(ck, marker), "__0_0.distcp")):
        tampering()
        for resume in ([], ["--resume", "latest"], ["--resume", str(ck)]):   # auto (the default), latest, step-N
            capsys.readouterr()
            assert main(train + resume) == 2
            _one_error_line(capsys, "CheckpointUntrustedError", f"file {file}:")
        assert main(["export-hf", str(ck), "--out", str(tmp_path / "hf")]) == 2
        _one_error_line(capsys, "CheckpointUntrustedError", f"file {file}:")
        with pytest.raises(CheckpointUntrustedError) as e:
            consolidated(ck)
        assert e.value.file == file
        assert not marker.exists()
        tamper.restore(ck, saved)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-2"]   # nothing trained over it
    assert len(consolidated(ck)) > 100


def test_a_checkpoint_key_refuses_checkpoints_it_did_not_sign(world_of_one, tmp_path, monkeypatch, capsys):
    key, other = tmp_path / "key", tmp_path / "other"
    key.write_text("our team's key, 32 bytes or so\n")
    other.write_text("somebody else's key\n")
    monkeypatch.delenv(checkpoint_key.ENV, raising=False)
    base = dict(TITAN, checkpoint_dir=str(tmp_path / "ckpt"))
    Trainer(TrainConfig(steps=2, checkpoint_key=str(key), **base)).fit()
    ck = tmp_path / "ckpt" / "step-2"
    body = manifest.read(ck)
    assert checkpoint_key.FIELD in body and all("sha256" in e for e in body["files"].values())
    assert not any(b"our team" in p.read_bytes() for p in ck.iterdir())   # the key is never written

    assert Trainer(TrainConfig(steps=3, checkpoint_key=str(key), **base)).step == 2   # signed with it: loads
    assert Trainer(TrainConfig(steps=3, **base)).step == 2                            # no key: integrity only

    def refused(**kw) -> CheckpointUntrustedError:
        with pytest.raises(CheckpointUntrustedError) as e:
            Trainer(TrainConfig(steps=3, **base, **kw))
        assert e.value.file == "manifest.json", e.value
        return e.value

    assert "does not match this key" in str(refused(checkpoint_key=str(other)))
    monkeypatch.setenv(checkpoint_key.ENV, "somebody else's key")   # the key from the environment
    assert "does not match this key" in str(refused())
    monkeypatch.delenv(checkpoint_key.ENV)
    saved = tamper.snapshot(ck)
    tamper.as_pickle(ck, ".metadata", tmp_path / "marker")   # the manifest recomputed, without the key
    assert "no keyed digest" in str(refused(checkpoint_key=str(key)))
    assert main(["export-hf", str(ck), "--out", str(tmp_path / "hf"), "--checkpoint-key", str(key)]) == 2
    _one_error_line(capsys, "CheckpointUntrustedError", "manifest.json")
    tamper.restore(ck, saved)
    assert not (tmp_path / "marker").exists()


def test_a_sha256_entry_catches_what_a_crc_misses(tmp_path):
    """A signed manifest binds files by SHA-256: a change whose CRC-32 and size match (four bytes
    chosen to match are enough) is still found."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"a" * 100)
    want = manifest.entries(tmp_path, ["f.bin"], sha256=True)["f.bin"]
    f.write_bytes(b"b" * 100)
    forged = dict(want, crc32=manifest.digest(f)[1])   # as if the CRC had been matched
    assert "sha256" in manifest.check_file(tmp_path, "f.bin", forged)
    assert manifest.check_file(tmp_path, "f.bin", manifest.entries(tmp_path, ["f.bin"], sha256=True)["f.bin"]) is None


def test_key_settings_are_checked_up_front(tmp_path, monkeypatch):
    with pytest.raises(TrainConfigError, match="--checkpoint-key"):
        checkpoint_key.resolve(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(TrainConfigError, match="empty"):
        checkpoint_key.resolve(str(tmp_path / "empty"))
    monkeypatch.setenv(checkpoint_key.ENV, "")
    with pytest.raises(TrainConfigError, match=checkpoint_key.ENV):
        checkpoint_key.resolve()
    monkeypatch.setenv(checkpoint_key.ENV, "k")
    assert checkpoint_key.resolve() == b"k"
