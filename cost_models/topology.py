"""Which link level each mesh dimension crosses.

Ranks are laid out row-major over the mesh (the last dimension varies fastest, so ``tp`` placed last
stays inside a node, as torchtitan does), and consecutive global ranks share a node. A dimension's
group members are ``stride`` ranks apart, stride = product of the sizes after it. The group stays
inside one node when its whole span fits in a node; otherwise the slowest link it uses (a ring
has to cross nodes) is the inter-node link.

The inter-node link of a profile is one device's NIC (DGX A100/H100: one InfiniBand NIC per GPU).
A group with ``rails`` members in each node crosses nodes over that many NICs at once: NCCL
spreads its ring channels over the node's NICs, each channel carrying 1/rails of the data, so
ring collectives (all-reduce, all-gather, reduce-scatter, broadcast) see ``rails`` times the NIC
bandwidth, capped by the intra-node link. Point-to-point and all-to-all traffic keeps one NIC.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from cost_models.collectives import MEASURED_KINDS, Algorithm, Kind, bus_bandwidth, collective_time
from cost_models.hardware import load_hardware
from cost_models.hardware.profile import HardwareProfile, Link
from hyper_parallel.parallel_dims import ParallelDims


RING_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@dataclass(frozen=True)
class MeshDim:
    name: str
    size: int
    stride: int
    inter_node: bool
    link: Link
    link_efficiency: float = 1.0
    rails: int = 1                  # group members per node when it crosses nodes (NICs used at once)
    rail_cap: float = 0.0           # bandwidth bound of the rails together (intra-node link); 0: none

    def link_for(self, kind: str) -> Link:
        """The link a collective of ``kind`` sees: ring collectives of a cross-node group spread
        over its ``rails`` NICs (module docstring)."""
        if self.rails <= 1 or kind not in RING_KINDS:
            return self.link
        bw = self.link.bandwidth * self.rails
        if self.rail_cap > 0:
            bw = min(bw, self.rail_cap)
        return Link(f"{self.link.name}x{self.rails}", bw, self.link.latency)

    def bus_bandwidth(self, kind: str, nbytes: float) -> float:
        """Achieved bytes/s of the wire bytes of one ``kind`` collective of ``nbytes`` here."""
        link = self.link_for(kind)
        if kind not in MEASURED_KINDS:
            return link.bandwidth * self.link_efficiency
        return bus_bandwidth(link, nbytes, self.link_efficiency)

    def time(self, kind: Kind, nbytes: float, algorithm: Algorithm = "ring") -> float:
        """Seconds for one collective of ``kind`` over this dimension's groups."""
        return collective_time(kind, nbytes, self.size, self.link_for(kind), algorithm, self.link_efficiency)


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


def members_per_node(shape: Sequence[int], dim: int, devices_per_node: int) -> int:
    """How many of one group's members of mesh dimension ``dim`` share a node (>= 1): members
    are ``stride`` ranks apart, so a node of ``devices_per_node`` consecutive ranks holds
    devices_per_node // stride of them (at most the group size)."""
    stride = math.prod(shape[dim + 1:])
    return max(1, min(int(shape[dim]), devices_per_node // max(stride, 1)))


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
                            inter_node=cross, link=inter if cross else intra, link_efficiency=eff,
                            rails=members_per_node(shape, i, dpn) if cross else 1,
                            rail_cap=intra.bandwidth if cross else 0.0))
    return MeshTopology(tuple(dims))


def mesh_topology(dims: ParallelDims) -> MeshTopology:
    """The priced links of a mesh description: its hardware profile's links, its devices per
    node (the profile's when the mesh does not say)."""
    hw = load_hardware(dims.hardware)
    return mesh_links(dims.shape, dims.names, hw, devices_per_node=dims.devices_per_node or hw.devices_per_node)
