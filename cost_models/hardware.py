"""Hardware: the ClusterSpec that joins devices and links into a cluster.

The device and link profiles themselves are cost_models/devices.py's (and
importable from here); a measured profile (`autopar calibrate`, cost_models/
measured.py) replaces a cluster's device and links (`ClusterSpec.with_profile`).

Profiles are data, shipped as YAML in `cost_models/profiles/` (devices.yaml,
links.yaml, clusters.yaml) with the source of every figure next to it. A user
describes their own machines in a YAML or JSON file of the same shape:

    cluster:                       # or the ClusterSpec fields at the top level
      nodes: 4
      gpus_per_node: 8
      device: my-gpu               # a shipped name or one defined below
      intra_node_link: nvlink4
      inter_node_link: ib-ndr      # or fabric: ib-ndr | ib-hdr | roce-400 | efa-v2 | ethernet-100g,
                                   # or fabric: {bandwidth_gbps: 400, latency_us: 6} per GPU
      topology: {rail_optimized: true, oversubscription: 2.0}   # optional: congestion.py
      host_memory_gib: 2048
    devices:                       # optional, same fields as devices.yaml
      my-gpu: {peak_tflops: {bf16: 500}, memory_gib: 96, ...}
    links: {}                      # optional, same fields as links.yaml

Every malformed value raises `ProfileError` naming the field and the file.
Units inside the package are SI: FLOP/s, bytes, bytes/s, seconds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# the profiles a ClusterSpec joins, importable from here as before they had a module of their own
from cost_models.devices import (GIB, GIGA, PROFILE_DIR, TERA, DeviceProfile, LinkProfile,  # noqa: F401
                                 get_device, get_link, load_devices, load_links, load_profile_file, shipped_clusters,
                                 shipped_devices, shipped_links)
from cost_models import fabric
from cost_models.congestion import Topology
from cost_models.errors import ClusterSizeError, ProfileError
from cost_models.fields import read_mapping, read_number, read_str
from cost_models.measured import Profile


@dataclass
class ClusterSpec:
    """nodes x gpus_per_node devices; intra-node and inter-node (per GPU) links.

    host_memory_bytes (per node) bounds what CPU offload can hold; host_link
    carries offload traffic; host_memory_bandwidth bounds a CPU optimizer step.
    `devices` / `links` hold profiles a user file defined inline.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    device: str = "h100-sxm"
    intra_node_link: str = "nvlink4"
    inter_node_link: str = "ib-ndr"
    host_memory_bytes: float = 2048 * GIB
    host_link: str = "pcie5"
    host_memory_bandwidth: float = 500 * GIGA
    name: str | None = None
    devices: dict = field(default_factory=dict)  # name -> DeviceProfile (user-defined)
    links: dict = field(default_factory=dict)  # name -> LinkProfile (user-defined)
    source: str = "<dict>"
    topology: Any = None  # cost_models.congestion.Topology: leaves, rails, oversubscription (None: non-blocking)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for key in ("nodes", "gpus_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProfileError(f"must be a positive integer, got {value!r}", field=key, file=self.source)
        for key in ("host_memory_bytes", "host_memory_bandwidth"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ProfileError(f"must be a positive number, got {value!r}", field=key, file=self.source)
        # Resolve names now so a typo fails at load time, not deep in a solve.
        get_device(self.device, self.devices, file=self.source, field="device")
        for key in ("intra_node_link", "inter_node_link", "host_link"):
            get_link(getattr(self, key), self.links, file=self.source, field=key)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def device_profile(self) -> DeviceProfile:
        return get_device(self.device, self.devices, file=self.source)

    @property
    def intra_link(self) -> LinkProfile:
        return get_link(self.intra_node_link, self.links, file=self.source)

    @property
    def inter_link(self) -> LinkProfile:
        return get_link(self.inter_node_link, self.links, file=self.source)

    @property
    def host_link_profile(self) -> LinkProfile:
        return get_link(self.host_link, self.links, file=self.source)

    def cache_key(self) -> tuple:
        """Hashable identity for memoising costs on this cluster."""
        # user-defined profiles are keyed by their values (frozen dataclasses print deterministically)
        custom = repr(sorted(self.devices.items())) + repr(sorted(self.links.items())) if (
            self.devices or self.links) else ""
        return (self.nodes, self.gpus_per_node, self.device, self.intra_node_link, self.inter_node_link,
                self.host_memory_bytes, self.host_link, self.host_memory_bandwidth, custom, self.topology)

    def with_profile(self, profile) -> "ClusterSpec":
        """This cluster priced with a measured profile (`autopar calibrate`'s file,
        a path or a cost_models.measured.Profile): its device and links replace ours."""
        return apply_profile(self, profile if isinstance(profile, Profile) else Profile.load(str(profile)))

    def with_nodes(self, nodes: int) -> "ClusterSpec":
        d = self.to_dict()
        d["nodes"] = nodes
        d.pop("world_size", None)  # derived: from_dict would check the old one against the new node count
        return ClusterSpec.from_dict(d, file=self.source)

    # -- plain data ---------------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "name": self.name,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "device": self.device,
            "intra_node_link": self.intra_node_link,
            "inter_node_link": self.inter_node_link,
            "host_memory_gib": self.host_memory_bytes / GIB,
            "host_link": self.host_link,
            "host_memory_bandwidth_gbs": self.host_memory_bandwidth / GIGA,
            "world_size": self.world_size,
        }
        if self.devices:
            d["devices"] = {k: v.to_dict() for k, v in sorted(self.devices.items())}
        if self.links:
            d["links"] = {k: v.to_dict() for k, v in sorted(self.links.items())}
        if self.topology is not None:
            d["topology"] = self.topology.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict, file: str = "<dict>") -> "ClusterSpec":
        d = read_mapping(d, "cluster", file)
        devices = {n: DeviceProfile.from_dict(n, v, file) for n, v in read_mapping(d.get("devices", {}), "devices", file).items()}
        links = {n: LinkProfile.from_dict(n, v, file) for n, v in read_mapping(d.get("links", {}), "links", file).items()}
        body = d.get("cluster", d)
        body = read_mapping(body, "cluster", file)
        base: dict = {}
        if "preset" in body:  # start from a preset, override what the file gives
            base = fabric.resolve(dict(_preset_body(read_str(body, "preset", "cluster", file), file)), links, file)
            if "fabric" in body:
                base.pop("inter_node_link", None)
        merged = fabric.resolve({**base, **{k: v for k, v in body.items() if k != "preset"}}, links, file)
        known = {"name", "nodes", "gpus_per_node", "device", "intra_node_link", "inter_node_link",
                 "host_memory_gib", "host_memory_bytes", "host_link", "host_memory_bandwidth_gbs", "world_size",
                 "topology"}
        unknown = sorted(set(merged) - known - {"devices", "links", "cluster"})
        if unknown:
            raise ProfileError(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})",
                               field=unknown[0], file=file)
        if "host_memory_bytes" in merged:
            host_mem = read_number(merged, "host_memory_bytes", "cluster", file)
        else:
            host_mem = read_number(merged, "host_memory_gib", "cluster", file, default=2048) * GIB
        nodes = merged.get("nodes", 1)
        gpn = merged.get("gpus_per_node", 8)
        spec = cls(
            nodes=nodes,
            gpus_per_node=gpn,
            device=read_str(merged, "device", "cluster", file),
            intra_node_link=read_str(merged, "intra_node_link", "cluster", file, default="nvlink4"),
            inter_node_link=read_str(merged, "inter_node_link", "cluster", file, default="ib-ndr"),
            host_memory_bytes=host_mem,
            host_link=read_str(merged, "host_link", "cluster", file, default="pcie5"),
            host_memory_bandwidth=read_number(merged, "host_memory_bandwidth_gbs", "cluster", file, default=500) * GIGA,
            name=merged.get("name"),
            devices=devices,
            links=links,
            source=file,
            topology=Topology.from_dict(merged["topology"], file) if merged.get("topology") is not None else None,
        )
        if "world_size" in merged and merged["world_size"] != spec.world_size:
            raise ProfileError(f"world_size {merged['world_size']} != nodes x gpus_per_node = {spec.world_size}",
                               field="world_size", file=file)
        return spec

    @classmethod
    def preset(cls, name: str, nodes: int | None = None) -> "ClusterSpec":
        """A shipped preset ('dgx-h100'), optionally 'dgx-h100:16' for 16 nodes."""
        if ":" in name and nodes is None:
            name, _, count = name.partition(":")
            if not count.isdigit() or int(count) < 1:
                raise ProfileError(f"node count after ':' must be a positive integer, got {count!r}", field="nodes")
            nodes = int(count)
        body = dict(_preset_body(name, str(PROFILE_DIR / "clusters.yaml")))
        body["name"] = name
        if nodes is not None:
            body["nodes"] = nodes
        return cls.from_dict(body, file=str(PROFILE_DIR / "clusters.yaml"))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "ClusterSpec":
        path = str(path)
        return cls.from_dict(load_profile_file(path), file=path)

    @classmethod
    def resolve(cls, x: Any) -> "ClusterSpec":
        """A ClusterSpec from a spec, a dict, a preset name ('dgx-h100', 'dgx-h100:4'),
        a device name (one node of 8), or a YAML/JSON file path."""
        if isinstance(x, ClusterSpec):
            return x
        if isinstance(x, dict):
            return cls.from_dict(x)
        if not isinstance(x, (str, os.PathLike)):
            raise ProfileError(f"cannot make a cluster from {type(x).__name__}", field="cluster")
        text = str(x)
        base = text.partition(":")[0]
        if base in shipped_clusters():
            return cls.preset(text)
        if base in shipped_devices():
            nodes = int(text.partition(":")[2] or 1) if text.partition(":")[2].isdigit() else 1
            return cls.from_dict({"device": base, "nodes": nodes, **_default_links_for(base)}, file=f"<device {base}>")
        if os.path.exists(text):
            return cls.from_file(text)
        raise ProfileError(
            f"'{text}' is not a cluster preset ({', '.join(sorted(shipped_clusters()))}), "
            f"a device ({', '.join(sorted(shipped_devices()))}) or an existing file",
            field="cluster")


# -- a total GPU count -> nodes x GPUs per node ------------------------------------
CLI_SPELLING = "cli"  # --gpus 16 --gpus-per-node 8
API_SPELLING = "api"  # gpus=16, gpus_per_node=8


def _option(spelling: str, name: str) -> str:
    return "--" + name.replace("_", "-") if spelling == CLI_SPELLING else name


def _spelled(spelling: str, name: str, value) -> str:
    return f"{_option(spelling, name)} {value}" if spelling == CLI_SPELLING else f"{name}={value}"


def split_gpu_count(gpus: int, gpus_per_node: int, *, per_node_given: bool = False, hardware: str = "",
                    spelling=CLI_SPELLING) -> tuple[int, int]:
    """(nodes, gpus_per_node) for `gpus` GPUs on nodes of `gpus_per_node`.

    Fewer GPUs than a node plan a share of one when the share divides it
    (4 of 8: a job's share); 7 of 8 is refused as the likely typo for 8
    unless the node size was given (`per_node_given`: the node really has
    7). A count that is not whole nodes is refused with the counts either
    side. Errors are ClusterSizeError, spelled for the CLI or the API."""
    g = lambda value: _spelled(spelling, "gpus", value)  # noqa: E731
    gpn_ = lambda value: _spelled(spelling, "gpus_per_node", value)  # noqa: E731
    of = f" of {hardware}" if hardware else ""
    if gpus < gpus_per_node:
        if per_node_given:
            raise ClusterSizeError(f"{g(gpus)} is less than {gpn_(gpus_per_node)}",
                                   hint=f"for a partial node drop {_option(spelling, 'gpus_per_node')} "
                                        f"(plans {gpus} GPUs on one node)")
        if gpus_per_node % gpus:
            # 1, 2 or 4 GPUs of an 8-GPU node are a job's share of one; 7 or 6 are far
            # more often a typo for 8 than a node with a dead GPU, so that takes saying.
            raise ClusterSizeError(f"{g(gpus)} is part of one {gpus_per_node}-GPU node{of} and not a share that "
                                   "divides it",
                                   hint=f"use {g(gpus_per_node)} (the whole node) or a divisor of {gpus_per_node}; "
                                        f"if the node really has {gpus} GPUs, say so: "
                                        f"{g(gpus)}{' ' if spelling == CLI_SPELLING else ', '}{gpn_(gpus)}")
        return 1, gpus  # part of one node (a workstation, or the GPUs a job was given)
    if gpus % gpus_per_node:
        where = f" ({hardware} has {gpus_per_node} GPUs per node)" if hardware else ""
        raise ClusterSizeError(f"{g(gpus)} is not a whole number of {gpus_per_node}-GPU nodes{where}",
                               hint=node_count_hint(gpus, gpus_per_node, spelling))
    return gpus // gpus_per_node, gpus_per_node


def node_count_hint(gpus: int, gpn: int, spelling=CLI_SPELLING) -> str:
    """What to pass instead of a GPU count that is not whole nodes: the whole
    node counts either side, or node sizes that divide it."""
    below, above = (gpus // gpn) * gpn, (gpus // gpn + 1) * gpn
    options = [f"{_spelled(spelling, 'gpus', n)} ({n // gpn} node{'s' if n // gpn > 1 else ''})"
               for n in (below, above) if n > 0]
    sizes = [g for g in range(gpn - 1, 1, -1) if gpus % g == 0]
    text = "use " + " or ".join(options)
    if sizes:
        text += (f"; if your nodes really have {sizes[0]} GPUs each, add "
                 f"{_spelled(spelling, 'gpus_per_node', sizes[0])} ({gpus // sizes[0]} nodes)")
    return text


def _fields_for_gpu_count(gpus, args: tuple, kwargs: dict) -> dict:
    """ClusterSpec's keyword fields for `ClusterSpec(gpus=N, device=..., ...)`:
    what `autopar plan --gpus N --device ...` plans on. The device (or preset)
    gives the node size and links; fields given explicitly win."""
    names = [f.name for f in ClusterSpec.__dataclass_fields__.values() if f.init]
    given = {**dict(zip(names, args)), **kwargs}
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ProfileError(f"gpus must be a positive integer, got {gpus!r}", field="gpus")
    device = given.pop("device", "h100-sxm")
    custom = given.get("devices") or {}
    base = (ClusterSpec.resolve(device) if isinstance(device, str) and device not in custom
            and (device.partition(":")[0] in shipped_devices() or device.partition(":")[0] in shipped_clusters())
            else None)
    fields = {k: getattr(base, k) for k in names if k != "nodes"} if base else {"device": device}
    gpn = given.get("gpus_per_node", fields.get("gpus_per_node", 8))
    if "nodes" in given:
        if given["nodes"] * gpn != gpus:
            raise ClusterSizeError(f"gpus={gpus} but nodes={given['nodes']} x gpus_per_node={gpn} = "
                                   f"{given['nodes'] * gpn}", hint="pass gpus= or nodes=, not both")
        nodes = given["nodes"]
    else:
        nodes, gpn = split_gpu_count(gpus, gpn, per_node_given="gpus_per_node" in given, hardware=str(device),
                                     spelling=API_SPELLING)
    return {**fields, **given, "nodes": nodes, "gpus_per_node": gpn}


def _accept_gpu_count(cls):
    """Let `ClusterSpec(gpus=N, ...)` take a total GPU count (see _fields_for_gpu_count)."""
    import functools
    import inspect

    fields_init = cls.__init__

    @functools.wraps(fields_init)
    def __init__(self, *args, gpus=None, **kwargs):
        if gpus is not None:
            kwargs, args = _fields_for_gpu_count(gpus, args, kwargs), ()
        fields_init(self, *args, **kwargs)

    signature = inspect.signature(fields_init)
    __init__.__signature__ = signature.replace(parameters=[
        *signature.parameters.values(),
        inspect.Parameter("gpus", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="int | None")])
    cls.__init__ = __init__
    return cls


_accept_gpu_count(ClusterSpec)


def _preset_body(name: str, file: str | None) -> dict:
    presets = shipped_clusters()
    if name not in presets:
        raise ProfileError(f"unknown cluster preset '{name}' (known: {', '.join(sorted(presets))})",
                           field="preset", file=file)
    return presets[name]


def _default_links_for(device: str) -> dict:
    """Links of the shipped preset that uses `device`, so 'a100-80g' gets NVLink3 + HDR."""
    for body in shipped_clusters().values():
        if body.get("device") == device:
            return {k: body[k] for k in ("intra_node_link", "inter_node_link", "host_link",
                                         "host_memory_gib", "host_memory_bandwidth_gbs") if k in body}
    return {}


def apply_profile(cluster, profile: Profile):
    """`cluster` with its device and links replaced by the measured ones (node
    counts, host memory and everything else kept)."""
    device = DeviceProfile.from_dict(profile.device_name, profile.device, profile.source)
    device = DeviceProfile(**{**vars(device), "measured": profile.compute})
    d = cluster.to_dict()
    d.pop("world_size", None)
    d.pop("devices", None)
    d.pop("links", None)
    spec = ClusterSpec.from_dict(d, file=cluster.source)
    spec.devices = {**cluster.devices, profile.device_name: device}
    spec.links = dict(cluster.links)
    spec.device = profile.device_name
    for tier, attr in (("intra_node", "intra_node_link"), ("inter_node", "inter_node_link")):
        measured = profile.collectives.get(tier)
        if measured is None:
            continue
        base = cluster.intra_link if tier == "intra_node" else cluster.inter_link
        fitted = measured.fit("all_reduce") or measured.fit("all_gather")
        bandwidth, latency = (base.bandwidth, base.latency_s) if fitted is None else (fitted[1], fitted[0])
        name = f"{profile.device_name}:{tier}"
        # built from the file form (6 digits), so a plan's copy of the cluster prices identically
        link = LinkProfile.from_dict(name, {"bandwidth_gbs": float(f"{bandwidth / 1e9:.6g}"), "bus_efficiency": 1.0,
                                            "latency_us": float(f"{latency * 1e6:.6g}"),
                                            "source": f"measured: {profile.source}"}, profile.source)
        spec.links[name] = LinkProfile(**{**vars(link), "measured": measured})
        setattr(spec, attr, name)
    spec.validate()
    return spec
