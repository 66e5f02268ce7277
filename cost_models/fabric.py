"""A cluster file's `fabric`: the network between nodes, by name or by its figures.

    fabric: ib-ndr          # a shipped link: ib-ndr, ib-hdr, ib-edr, roce-400, roce-200,
                            # efa-v2, efa-v1, ethernet-100g (one 100 GbE NIC per 8-GPU node)
    fabric: {bandwidth_gbps: 400, latency_us: 6, bus_efficiency: 0.85}   # per GPU

`fabric` names what `inter_node_link` names (one of the two, or both equal).
The figures form a link of their own (bandwidth per GPU per direction in Gb/s,
as NICs are sold; what NCCL's ring reaches of it; the per-hop latency the
gloo / alpha-beta path uses: across nodes on GPUs NCCL's model prices the
hops, cost_models/nccl.py). Topology (rails, oversubscription) is
cost_models/congestion.py's.
"""
from __future__ import annotations

from cost_models.devices import LinkProfile
from cost_models.errors import ProfileError

# names people write for a shipped link
ALIASES = {"ndr": "ib-ndr", "hdr": "ib-hdr", "efa": "efa-v2"}
CUSTOM = "fabric"  # the link a fabric given by its figures is stored as


def resolve(merged: dict, links: dict, file: str) -> dict:
    """`merged` (a cluster body) with `fabric` turned into `inter_node_link` (and, for
    figures, a link added to `links`). Raises ProfileError on a clash or a bad figure."""
    if "fabric" not in merged:
        return merged
    body = {k: v for k, v in merged.items() if k != "fabric"}
    fabric = merged["fabric"]
    if isinstance(fabric, dict):
        known = {"bandwidth_gbps", "latency_us", "bus_efficiency"}
        if set(fabric) - known or "bandwidth_gbps" not in fabric:
            raise ProfileError(f"fabric takes {', '.join(sorted(known))} (bandwidth_gbps required), got "
                               f"{', '.join(sorted(fabric))}", field="fabric", file=file)
        gbps = fabric["bandwidth_gbps"]
        if isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or gbps <= 0:
            raise ProfileError(f"fabric.bandwidth_gbps must be a positive number, got {gbps!r}", field="fabric",
                               file=file)
        links[CUSTOM] = LinkProfile.from_dict(CUSTOM, {
            "bandwidth_gbs": gbps / 8, "latency_us": fabric.get("latency_us", 6),
            "bus_efficiency": fabric.get("bus_efficiency", 0.85),
            "source": f"cluster file fabric: {gbps} Gb/s per GPU"}, file)
        name = CUSTOM
    elif isinstance(fabric, str):
        name = ALIASES.get(fabric, fabric)
    else:
        raise ProfileError(f"fabric must be a link name or a mapping, got {fabric!r}", field="fabric", file=file)
    if "inter_node_link" in merged and merged["inter_node_link"] != name:
        raise ProfileError(f"fabric '{name}' and inter_node_link '{merged['inter_node_link']}' disagree: give one",
                           field="fabric", file=file)
    body["inter_node_link"] = name
    return body
