"""The measured ``cpu`` profile is measured once per host when a job's ranks ask for it at the same
time: each rank measuring under the others' load got other numbers, hence other plans (ranks of an
``autoplan train`` job disagreed on the pipeline schedule). One process measures under a lock, the
others wait and read the profile it wrote, whole (written to a temporary file and renamed)."""
import dataclasses
import json
import multiprocessing as mp
import os
import time

from cost_models.hardware import host, load_hardware


def _slow_measure(reps: int = 7):
    """A stand-in measurement: slow (the others arrive meanwhile) and different in each process."""
    with open(os.path.join(os.environ["AUTOPLAN_CACHE_DIR"], "measured.log"), "a") as f:
        f.write(f"{os.getpid()}\n")
    time.sleep(1.0)
    return dataclasses.replace(load_hardware("h100_sxm"), name="cpu", memory_bandwidth=float(os.getpid()))


def _ask(cache_dir: str, out, start) -> None:
    os.environ["AUTOPLAN_CACHE_DIR"] = cache_dir
    host.measure_host_profile = _slow_measure
    start.wait()   # every process asks at once, as a job's ranks do
    out.put(host.measure_host().memory_bandwidth)


def test_ranks_asking_at_once_measure_once_and_read_the_same_profile(tmp_path):
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_ask, args=(str(tmp_path), out, start)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    measured = (tmp_path / "measured.log").read_text().split()
    assert len(measured) == 1, measured
    assert got == [float(measured[0])] * 2, (got, measured)
    files = list((tmp_path / "hardware").iterdir())
    assert not [f for f in files if f.name.endswith(".tmp")], files
    cached = next(f for f in files if f.suffix == ".json")
    assert json.loads(cached.read_text())["memory_bandwidth"] == float(measured[0])
