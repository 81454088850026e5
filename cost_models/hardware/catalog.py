"""The catalogue of hardware profiles: the datasheet JSON files in this folder, and ``cpu``.

Apart from :mod:`cost_models.hardware.profile` (the data type) because ``cpu`` is not a file: it
is measured on the current host by :mod:`cost_models.hardware.host`, which builds a profile --
so the profile type cannot also be the place that calls the measurement.
"""
from __future__ import annotations

import json
from importlib import resources

from cost_models.errors import UnknownHardwareError
from cost_models.hardware.host import measure_host
from cost_models.hardware.profile import HardwareProfile


def list_hardware() -> list[str]:
    """Names of the profiles shipped as data files, plus ``cpu`` (measured on demand)."""
    names = sorted(p.name[:-5] for p in resources.files(__package__).iterdir() if p.name.endswith(".json"))
    return names + ["cpu"]


def load_hardware(name: str, *, remeasure: bool = False) -> HardwareProfile:
    """The profile called ``name`` (case-insensitive, '-' or '_'). ``cpu`` measures this host once and caches it."""
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    if key == "cpu":
        return measure_host(force=remeasure)
    path = resources.files(__package__) / f"{key}.json"
    if not path.is_file():
        raise UnknownHardwareError(f"load_hardware(name={name!r}): no such profile; known: {list_hardware()}")
    return HardwareProfile.from_dict(json.loads(path.read_text()))
