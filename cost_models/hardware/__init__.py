"""Hardware profiles (datasheet JSON files with sources) and the measured profile of this host."""
from cost_models.hardware.catalog import list_hardware, load_hardware
from cost_models.hardware.profile import Efficiency, HardwareProfile, Link, dtype_key

__all__ = ["Efficiency", "HardwareProfile", "Link", "dtype_key", "list_hardware", "load_hardware"]
