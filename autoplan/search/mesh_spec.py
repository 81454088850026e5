"""An offline description of a device mesh, so a laptop can plan for any world size.

A plan is made for a mesh shape, its dimension names, a hardware kind and the devices per node;
no process group is needed. A live DeviceMesh converts to this description.

Dimension names are a fixed vocabulary (``MESH_ROLES``): every name says which parallelism its
dimension carries, so the planner never guesses (a 1-D mesh named ``dp`` is data parallel, not
tensor parallel as well) and never uses one dimension for two parallelisms. A name outside the
vocabulary ("x", "dim0") is an error naming the valid ones.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from autoplan.errors import MeshNameError, PlanningError
from cost_models.hardware import load_hardware
from cost_models.topology import mesh_links

# role -> the names that mean it (the first is the canonical one)
MESH_ROLES: dict[str, tuple[str, ...]] = {
    "dp": ("dp", "data", "fsdp", "dp_shard"),
    # HSDP: the replicated half of data parallel, beside a sharded dp dimension (autoplan/hsdp.py)
    "dp_replicate": ("dp_replicate",),
    "tp": ("tp", "model", "tensor"),
    "pp": ("pp", "pipe", "pipeline"),
    "cp": ("cp", "context"),
    "ep": ("ep", "expert"),
}
_ROLE_OF = {alias: role for role, aliases in MESH_ROLES.items() for alias in aliases}


def vocabulary() -> str:
    """The accepted names, for error messages: 'dp (data, fsdp, ...), tp (model, tensor), ...'."""
    return ", ".join(f"{a[0]} ({', '.join(a[1:])})" for a in MESH_ROLES.values())


def role_of(name: str) -> str:
    """The parallelism dimension ``name`` carries ("fsdp" -> "dp"); MeshNameError if unknown."""
    try:
        return _ROLE_OF[name]
    except (KeyError, TypeError):
        raise MeshNameError(f"mesh dimension name {name!r} does not say which parallelism it carries; "
                            f"use one of: {vocabulary()}") from None


def mesh_roles(names) -> dict[str, str]:
    """{role: dimension name} for a mesh's names; each role at most once, every name known."""
    out: dict[str, str] = {}
    for name in names:
        role = role_of(name)
        if role in out:
            raise MeshNameError(f"mesh dimensions {out[role]!r} and {name!r} both mean {role!r}; one dimension "
                                "per parallelism (hybrid sharding: name them dp_replicate and dp_shard)")
        out[role] = name
    return out


@dataclass(frozen=True)
class MeshSpec:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    hardware: str = "h100_sxm"
    devices_per_node: int | None = None  # None: the hardware profile's value

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.names):
            raise PlanningError(f"MeshSpec: shape {self.shape} and names {self.names} differ in length")
        if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in self.shape):
            raise PlanningError(f"MeshSpec: shape {self.shape} must be positive integers")
        if len(set(self.names)) != len(self.names):
            raise PlanningError(f"MeshSpec: names {self.names} repeat a dimension")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "names", tuple(self.names))
        mesh_roles(self.names)  # every name says which parallelism it is

    def dim(self, role: str) -> str | None:
        """The name of the dimension carrying ``role`` ("tp", "dp", "pp", "cp", "ep"), or None."""
        return mesh_roles(self.names).get(role)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    def degree(self, name: str) -> int:
        """Size of dimension ``name``; 1 if the mesh has no such dimension."""
        return self.shape[self.names.index(name)] if name in self.names else 1

    def hardware_profile(self):
        return load_hardware(self.hardware)

    def topology(self):
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
        names = mesh.mesh_dim_names
        if not names:
            raise MeshNameError(f"autoplan: the DeviceMesh of shape {tuple(mesh.shape)} has no mesh_dim_names; "
                                f"name its dimensions (init_device_mesh(..., mesh_dim_names=...)) from: "
                                f"{vocabulary()}")
        if hardware is None:
            hardware = "cpu" if mesh.device_type == "cpu" else "h100_sxm"
        return cls(tuple(mesh.shape), tuple(names), hardware)
