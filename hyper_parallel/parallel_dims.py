"""ParallelDims: the one description of a device mesh -- which parallelism each dimension
carries, its degree, and the node topology -- shared by the runtime, the planner, plan files and
verify.

A plan is made for a mesh shape, its dimension names, a hardware kind and the devices per node,
with no process group; the runtime builds the live DeviceMesh from the same object
(:meth:`ParallelDims.build_mesh`) and a live DeviceMesh converts back
(:meth:`ParallelDims.from_device_mesh`). A plan file's ``mesh`` field is :meth:`to_dict`.

Dimension names come from a fixed vocabulary (``DIMENSIONS``): every name says which parallelism
its dimension carries, so nothing guesses (a 1-D mesh named ``dp`` is data parallel, not tensor
parallel as well) and no dimension serves two parallelisms. A name outside the vocabulary
("x", "dim0") is a :class:`MeshNameError` naming the valid ones. Hardware is carried as a profile
*name* only: pricing it is the cost model's business (``cost_models.topology.mesh_topology``).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from torch.distributed.device_mesh import init_device_mesh

from hyper_parallel.errors import MeshError, MeshNameError

# parallel dimension -> the mesh-dimension names that mean it (the first is the canonical one).
# Order is the canonical mesh order, outermost first (torchtitan's: pp, dp_replicate, dp_shard,
# cp, tp; ep borrows from data parallel and sits beside it).
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "pp": ("pp", "pipe", "pipeline"),
    # HSDP: the replicated half of data parallel, beside a sharded dp dimension
    "dp_replicate": ("dp_replicate",),
    "dp": ("dp", "data", "fsdp", "dp_shard"),
    "ep": ("ep", "expert"),
    "cp": ("cp", "context"),
    "tp": ("tp", "model", "tensor"),
}
_DIMENSION_OF = {alias: role for role, aliases in DIMENSIONS.items() for alias in aliases}


def vocabulary() -> str:
    """The accepted names, for error messages: 'pp (pipe, pipeline), dp (data, fsdp, ...), ...'."""
    return ", ".join(f"{a[0]} ({', '.join(a[1:])})" if len(a) > 1 else a[0] for a in DIMENSIONS.values())


def role_of(name: str) -> str:
    """The parallel dimension mesh dimension ``name`` carries ("fsdp" -> "dp"); MeshNameError if unknown."""
    try:
        return _DIMENSION_OF[name]
    except (KeyError, TypeError):
        raise MeshNameError(f"mesh dimension name {name!r} does not say which parallelism it carries; "
                            f"use one of: {vocabulary()}") from None


def mesh_roles(names) -> dict[str, str]:
    """{parallel dimension: mesh dimension name} for a mesh's names; each at most once, every name known."""
    out: dict[str, str] = {}
    for name in names:
        role = role_of(name)
        if role in out:
            raise MeshNameError(f"mesh dimensions {out[role]!r} and {name!r} both mean {role!r}; one dimension "
                                "per parallelism (hybrid sharding: name them dp_replicate and dp_shard)")
        out[role] = name
    return out


@dataclass(frozen=True)
class ParallelDims:
    """A mesh: ``shape`` and ``names`` outermost first, the hardware profile's name, and the
    devices per node (None: the profile's value) -- the topology the cost model prices links by."""

    shape: tuple[int, ...]
    names: tuple[str, ...]
    hardware: str = "h100_sxm"
    devices_per_node: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.shape, (str, bytes)) or not hasattr(self.shape, "__len__") \
                or isinstance(self.names, (str, bytes)) or not hasattr(self.names, "__len__"):
            raise MeshError(f"ParallelDims: shape {self.shape!r} and names {self.names!r} must be sequences")
        if len(self.shape) != len(self.names):
            raise MeshError(f"ParallelDims: shape {tuple(self.shape)} and names {tuple(self.names)} differ in length")
        if any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in self.shape):
            raise MeshError(f"ParallelDims: shape {tuple(self.shape)} must be positive integers")
        if len(set(self.names)) != len(self.names):
            raise MeshError(f"ParallelDims: names {tuple(self.names)} repeat a dimension")
        if self.devices_per_node is not None and (isinstance(self.devices_per_node, bool) or not isinstance(
                self.devices_per_node, numbers.Integral) or self.devices_per_node < 1):
            raise MeshError(f"ParallelDims: devices_per_node={self.devices_per_node!r} must be a positive integer "
                            "or None")
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "names", tuple(self.names))
        mesh_roles(self.names)  # every name says which parallelism it is

    # ------------------------------------------------------------------ queries
    @property
    def roles(self) -> dict[str, str]:
        """{parallel dimension: mesh dimension name}, e.g. {"dp": "fsdp", "tp": "model"}."""
        return mesh_roles(self.names)

    def dim(self, role: str) -> str | None:
        """The name of the mesh dimension carrying ``role`` ("tp", "dp", "pp", ...), or None."""
        return self.roles.get(role)

    def degree(self, name: str) -> int:
        """Size of mesh dimension ``name``; 1 if the mesh has no such dimension."""
        return self.shape[self.names.index(name)] if name in self.names else 1

    def degree_of(self, role: str) -> int:
        """Degree of parallel dimension ``role`` (1 if the mesh does not have it)."""
        name = self.dim(role)
        return self.degree(name) if name else 1

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    # ------------------------------------------------------------------ data
    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "names": list(self.names), "hardware": self.hardware,
                "devices_per_node": self.devices_per_node}

    @classmethod
    def from_dict(cls, data: dict) -> "ParallelDims":
        return cls(tuple(data["shape"]), tuple(data["names"]), data.get("hardware", "h100_sxm"),
                   data.get("devices_per_node"))

    # ------------------------------------------------------------------ live meshes
    @classmethod
    def from_device_mesh(cls, mesh, hardware: str | None = None) -> "ParallelDims":
        names = mesh.mesh_dim_names
        if not names:
            raise MeshNameError(f"the DeviceMesh of shape {tuple(mesh.shape)} has no mesh_dim_names; name its "
                                f"dimensions (init_device_mesh(..., mesh_dim_names=...)) from: {vocabulary()}")
        if hardware is None:
            hardware = "cpu" if mesh.device_type == "cpu" else "h100_sxm"
        return cls(tuple(mesh.shape), tuple(names), hardware)

    def build_mesh(self, device_type: str):
        """The live DeviceMesh of this shape and these names (the process group must be up and its
        world size equal to this mesh's)."""
        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)
