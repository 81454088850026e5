"""An offline description of a device mesh, so a laptop can plan for any world size.

A plan is made for a mesh shape, its dimension names, a hardware kind and the devices per node;
no process group is needed. A live DeviceMesh converts to this description.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.errors import PlanningError


@dataclass(frozen=True)
class MeshSpec:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    hardware: str = "h100_sxm"
    devices_per_node: int | None = None  # None: the hardware profile's value

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.names):
            raise PlanningError(f"MeshSpec: shape {self.shape} and names {self.names} differ in length")
        if any(int(s) < 1 for s in self.shape):
            raise PlanningError(f"MeshSpec: shape {self.shape} has a dimension < 1")
        if len(set(self.names)) != len(self.names):
            raise PlanningError(f"MeshSpec: names {self.names} repeat a dimension")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "names", tuple(self.names))

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def degree(self, name: str) -> int:
        """Size of dimension ``name``; 1 if the mesh has no such dimension."""
        return self.shape[self.names.index(name)] if name in self.names else 1

    def hardware_profile(self):
        from cost_models.hardware import load_hardware

        return load_hardware(self.hardware)

    def topology(self):
        from cost_models.topology import mesh_links

        hw = self.hardware_profile()
        return mesh_links(self.shape, self.names, hw, devices_per_node=self.devices_per_node or hw.devices_per_node)

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "names": list(self.names), "hardware": self.hardware,
                "devices_per_node": self.devices_per_node}

    @classmethod
    def from_dict(cls, data: dict) -> "MeshSpec":
        return cls(tuple(data["shape"]), tuple(data["names"]), data.get("hardware", "h100_sxm"),
                   data.get("devices_per_node"))

    @classmethod
    def from_device_mesh(cls, mesh, hardware: str | None = None) -> "MeshSpec":
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        if hardware is None:
            hardware = "cpu" if mesh.device_type == "cpu" else "h100_sxm"
        return cls(tuple(mesh.shape), tuple(names), hardware)
