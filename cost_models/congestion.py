"""Congestion: many groups on the fabric at once.

Every collective of a mesh axis runs on all its groups at the same moment (the
ranks step in lockstep), so when a group crosses the network every GPU's NIC
sends at once. Under one leaf switch each NIC has its own port; past the leaf
the traffic shares the leaf's uplinks to the spine, and a leaf with more ports
down than up (oversubscription o = down / up) gives each NIC 1 / o of its
bandwidth there. Which groups stay under one leaf is the topology's:

- rail-optimized (NVIDIA's DGX SuperPOD reference architecture, and its
  H100 scalable unit of 32 nodes): NIC i of every node goes to leaf i, so a
  leaf of d ports down serves d nodes, and NCCL keeps a ring's traffic on one
  rail (PXN), so a group over at most d nodes never reaches the spine;
- not rail-optimized (a top-of-rack leaf per few nodes): a leaf serves d
  NICs, d / gpus_per_node nodes, and any group over more crosses the spine.

A leaf of `leaf_ports` ports splits them o : 1 between down and up (NVIDIA
Quantum-2 QM9700: 64 ports of 400 Gb/s, `LEAF_PORTS`; 32 down at o = 1).

    topology: {rail_optimized: true, oversubscription: 2.0, leaf_ports: 64}

in a cluster file (absent: rail-optimized and non-blocking, as the DGX
SuperPOD reference architectures are: every group keeps the bandwidth its
NICs have). Point-to-point sends (pipeline stages) are not lockstep across
the whole job and are not scaled.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from cost_models.errors import ProfileError

LEAF_PORTS = 64  # NVIDIA Quantum-2 QM9700 / QM9790: 64 x 400 Gb/s NDR ports (datasheet)


@dataclass(frozen=True)
class Topology:
    rail_optimized: bool = True
    oversubscription: float = 1.0  # ports down / ports up at a leaf
    leaf_ports: int = LEAF_PORTS

    @classmethod
    def from_dict(cls, d, file: str) -> "Topology":
        if not isinstance(d, dict) or set(d) - {"rail_optimized", "oversubscription", "leaf_ports"}:
            raise ProfileError(f"topology takes rail_optimized, oversubscription, leaf_ports, got {d!r}",
                               field="topology", file=file)
        t = cls(**d)
        if not isinstance(t.rail_optimized, bool):
            raise ProfileError(f"topology.rail_optimized must be true or false, got {t.rail_optimized!r}",
                               field="topology", file=file)
        if isinstance(t.oversubscription, bool) or not isinstance(t.oversubscription, (int, float)) or \
                t.oversubscription < 1:
            raise ProfileError(f"topology.oversubscription must be a number >= 1 (down : up ports), got "
                               f"{t.oversubscription!r}", field="topology", file=file)
        if isinstance(t.leaf_ports, bool) or not isinstance(t.leaf_ports, int) or t.leaf_ports < 2:
            raise ProfileError(f"topology.leaf_ports must be an integer >= 2, got {t.leaf_ports!r}",
                               field="topology", file=file)
        return t

    def to_dict(self) -> dict:
        return asdict(self)

    def nodes_per_leaf(self, gpus_per_node: int) -> int:
        down = int(self.leaf_ports * self.oversubscription / (1 + self.oversubscription))
        return max(1, down if self.rail_optimized else down // gpus_per_node)


def network_share(nodes_spanned: int, gpus_per_node: int, topology: Topology | None) -> float:
    """The share of its NIC bandwidth each GPU of a group over `nodes_spanned` nodes keeps
    while every group of its axis runs at once: 1 under one leaf, 1 / oversubscription past it."""
    if topology is None or nodes_spanned <= topology.nodes_per_leaf(gpus_per_node):
        return 1.0
    return 1.0 / topology.oversubscription
