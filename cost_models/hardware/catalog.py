"""The catalogue of hardware profiles: the datasheet JSON files in this folder, and ``cpu``.

Apart from :mod:`cost_models.hardware.profile` (the data type) because ``cpu`` is not a file: it
is measured on the current host by :mod:`cost_models.hardware.host`, which builds a profile --
so the profile type cannot also be the place that calls the measurement.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from cost_models.errors import UnknownHardwareError
from cost_models.hardware.host import measure_host
from cost_models.hardware.profile import HardwareProfile


def list_hardware() -> list[str]:
    """Names of the profiles shipped as data files, plus ``cpu`` (measured on demand)."""
    names = sorted(p.name[:-5] for p in resources.files(__package__).iterdir() if p.name.endswith(".json"))
    return names + ["cpu"]


def load_hardware(name: "str | Path | HardwareProfile", *, remeasure: bool = False) -> HardwareProfile:
    """The profile called ``name`` (case-insensitive, '-' or '_'). ``cpu`` measures this host once and
    caches it. A path to a ``.json`` file loads that profile (one written by ``autoplan profile
    --kernels --write-profile``: a datasheet profile with the device's measured kernels); a profile
    object is returned as it is."""
    if isinstance(name, HardwareProfile):
        return name
    if isinstance(name, Path) or str(name).endswith(".json"):
        path = Path(name)
        if not path.is_file():
            raise UnknownHardwareError(f"load_hardware(name={str(name)!r}): no such file")
        try:
            return HardwareProfile.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise UnknownHardwareError(f"load_hardware(name={str(name)!r}): not JSON: {exc}") from exc
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if key == "cpu":
        return measure_host(force=remeasure)
    path = resources.files(__package__) / f"{key}.json"
    if not path.is_file():
        raise UnknownHardwareError(f"load_hardware(name={name!r}): no such profile; known: {list_hardware()}")
    return HardwareProfile.from_dict(json.loads(path.read_text()))
