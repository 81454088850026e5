"""Which link level each mesh dimension crosses.

Ranks are laid out row-major over the mesh (the last dimension varies fastest, so ``tp`` placed last
stays inside a node, as torchtitan does), and consecutive global ranks share a node. A dimension's
group members are ``stride`` ranks apart, stride = product of the sizes after it. The group stays
inside one node when its whole span fits in a node; otherwise the slowest link it uses (a ring
has to cross nodes) is the inter-node link.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cost_models.collectives import Algorithm, Kind, collective_time
from cost_models.hardware.profile import HardwareProfile, Link


@dataclass(frozen=True)
class MeshDim:
    name: str
    size: int
    stride: int
    inter_node: bool
    link: Link
    link_efficiency: float = 1.0

    def time(self, kind: Kind, nbytes: float, algorithm: Algorithm = "ring") -> float:
        """Seconds for one collective of ``kind`` over this dimension's groups."""
        return collective_time(kind, nbytes, self.size, self.link, algorithm, self.link_efficiency)


def crosses_nodes(shape: Sequence[int], dim: int, devices_per_node: int) -> bool:
    """True when the groups of mesh dimension ``dim`` span more than one node."""
    if devices_per_node < 1:
        raise ValueError(f"devices_per_node={devices_per_node} must be >= 1")
    if shape[dim] == 1:
        return False
    # members are stride ranks apart; each block of stride*size consecutive ranks holds whole groups,
    # so the groups stay in a node exactly when blocks tile the node
    block = math.prod(shape[dim:])
    return devices_per_node % block != 0


@dataclass(frozen=True)
class MeshTopology:
    """Per-dimension links of a device mesh on one hardware kind."""

    dims: tuple[MeshDim, ...]

    def __getitem__(self, name: str) -> MeshDim:
        for d in self.dims:
            if d.name == name:
                return d
        raise KeyError(f"mesh dimension {name!r} not in {[d.name for d in self.dims]}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    def collective_time(self, dim: str, kind: Kind, nbytes: float, algorithm: Algorithm = "ring") -> float:
        return self[dim].time(kind, nbytes, algorithm)


def mesh_links(shape: Sequence[int], names: Sequence[str], hardware: HardwareProfile | None = None, *,
               devices_per_node: int | None = None, intra: Link | None = None,
               inter: Link | None = None) -> MeshTopology:
    """MeshTopology for a mesh ``shape`` with dimension ``names`` (outermost first).

    Links and devices per node come from ``hardware`` unless given explicitly.
    """
    if len(shape) != len(names):
        raise ValueError(f"mesh_links: shape={tuple(shape)} and names={tuple(names)} differ in length")
    if any(int(s) < 1 for s in shape):
        raise ValueError(f"mesh_links: shape={tuple(shape)} has a size < 1")
    if hardware is None and (devices_per_node is None or intra is None or inter is None):
        raise ValueError("mesh_links: give hardware= or all of devices_per_node=, intra=, inter=")
    dpn = devices_per_node if devices_per_node is not None else hardware.devices_per_node
    intra = intra or hardware.intra_node
    inter = inter or hardware.inter_node
    eff = hardware.efficiency.link if hardware is not None else 1.0
    dims = []
    for i, (size, name) in enumerate(zip(shape, names)):
        cross = crosses_nodes(shape, i, dpn)
        dims.append(MeshDim(name=name, size=int(size), stride=math.prod(shape[i + 1:]),
                            inter_node=cross, link=inter if cross else intra, link_efficiency=eff))
    return MeshTopology(tuple(dims))
