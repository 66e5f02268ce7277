"""Hardware profiles: devices, links, and the ClusterSpec that joins them.

Profiles are data, shipped as YAML in `cost_models/profiles/` (devices.yaml,
links.yaml, clusters.yaml) with the source of every figure next to it. A user
describes their own machines in a YAML or JSON file of the same shape:

    cluster:                       # or the ClusterSpec fields at the top level
      nodes: 4
      gpus_per_node: 8
      device: my-gpu               # a shipped name or one defined below
      intra_node_link: nvlink4
      inter_node_link: ib-ndr
      host_memory_gib: 2048
    devices:                       # optional, same fields as devices.yaml
      my-gpu: {peak_tflops: {bf16: 500}, memory_gib: 96, ...}
    links: {}                      # optional, same fields as links.yaml

Every malformed value raises `ProfileError` naming the field and the file.
Units inside the package are SI: FLOP/s, bytes, bytes/s, seconds.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from cost_models.errors import ClusterSizeError, CostModelError, ProfileError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
GIB = 1024**3
TERA = 1e12
GIGA = 1e9


# -- field readers: each names the field and the file when it fails -----------
def _num(d: dict, key: str, where: str, file: str, *, positive=True, allow_zero=False, default=None) -> float:
    if key not in d or d[key] is None:
        if default is not None:
            return float(default)
        raise ProfileError("missing required field", field=f"{where}.{key}", file=file)
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"must be a number, got {value!r}", field=f"{where}.{key}", file=file)
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        raise ProfileError(f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}",
                           field=f"{where}.{key}", file=file)
    return float(value)


def _fraction(d: dict, key: str, where: str, file: str, default=None, allow_zero=False) -> float:
    value = _num(d, key, where, file, default=default, allow_zero=allow_zero)
    if value > 1.0:
        raise ProfileError(f"is a fraction and must be <= 1, got {value!r}", field=f"{where}.{key}", file=file)
    return value


def _str(d: dict, key: str, where: str, file: str, default: str | None = None) -> str:
    value = d.get(key, default)
    if value is None:
        raise ProfileError("missing required field", field=f"{where}.{key}", file=file)
    if not isinstance(value, str) or not value:
        raise ProfileError(f"must be a non-empty string, got {value!r}", field=f"{where}.{key}", file=file)
    return value


def _mapping(d: Any, where: str, file: str) -> dict:
    if not isinstance(d, dict):
        raise ProfileError(f"must be a mapping, got {type(d).__name__}", field=where, file=file)
    return d


@dataclass(frozen=True)
class DeviceProfile:
    """One accelerator. Every number is per device."""

    name: str
    peak_flops: dict  # dtype -> dense FLOP/s
    memory_bytes: float
    memory_bandwidth: float  # B/s, HBM peak
    memory_efficiency: float  # sustained fraction of memory_bandwidth
    reserve_bytes: float  # CUDA context, library workspaces, NCCL buffers
    num_sms: int
    gemm_max_efficiency: float  # best large-GEMM fraction of peak (MAMF)
    attention_fwd_efficiency: float
    attention_bwd_efficiency: float
    kernel_launch_s: float
    sustained_clock_fraction: float = 1.0  # clock held at the power limit / clock the peak assumes
    clock_spread: float = 0.0  # std dev of sustained speed across GPUs of one model (fraction); see stragglers.py
    vendor: str = "nvidia"
    source: str = ""
    # share of a collective that can run hidden under compute: 1 where the transport has
    # its own engines (GPU copy engines / NIC, NCCL's few SMs: cost_models/comm.py); on
    # CPU ranks gloo's threads need the cores compute is using (measured by calibrate)
    collective_overlap: float = 1.0
    # how many times longer a GEMM runs when a row (n or k) is not a multiple of 16 bytes:
    # BLAS then cannot use its aligned tensor-core kernels (cost_models/compute._aligned)
    unaligned_gemm_slowdown: float = 1.0
    # host time per op forward / per autograd node backward, and FSDP2's per unit and
    # collective (hooks, copies): a GPU layer takes the larger of device and host time
    host_op_fwd_s: float = 0.0
    host_op_bwd_s: float = 0.0
    fsdp_unit_host_s: float = 0.0
    fsdp_tensor_host_s: float = 0.0  # per parameter tensor of the unit beyond the first
    # what `autopar calibrate` timed on this device (cost_models/measured.py); when set,
    # its tables price GEMMs, memory-bound ops, attention and per-op host time
    measured: Any = None

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for `dtype` ('bf16', 'fp16', 'fp32', 'tf32', 'fp8')."""
        try:
            return self.peak_flops[dtype]
        except KeyError:
            raise CostModelError(
                f"device '{self.name}' has no {dtype} peak in its profile "
                f"(it lists {', '.join(sorted(self.peak_flops))}); choose another precision"
            ) from None

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes - self.reserve_bytes

    @classmethod
    def from_dict(cls, name: str, d: dict, file: str = "<dict>") -> "DeviceProfile":
        where = f"devices.{name}"
        d = _mapping(d, where, file)
        peaks = _mapping(d.get("peak_tflops"), f"{where}.peak_tflops", file) if "peak_tflops" in d else None
        if not peaks:
            raise ProfileError("missing required field (dense TFLOP/s per dtype)", field=f"{where}.peak_tflops", file=file)
        peak_flops = {str(k): _num(peaks, k, f"{where}.peak_tflops", file) * TERA for k in peaks}
        memory = _num(d, "memory_gib", where, file) * GIB
        reserve = _num(d, "reserve_gib", where, file, allow_zero=True, default=1.0) * GIB
        if reserve >= memory:
            raise ProfileError(f"reserve ({reserve / GIB} GiB) must be below memory_gib", field=f"{where}.reserve_gib", file=file)
        return cls(
            name=name,
            peak_flops=peak_flops,
            memory_bytes=memory,
            memory_bandwidth=_num(d, "memory_bandwidth_tbs", where, file) * TERA,
            memory_efficiency=_fraction(d, "memory_efficiency", where, file, default=0.85),
            reserve_bytes=reserve,
            num_sms=int(_num(d, "num_sms", where, file, default=108)),
            gemm_max_efficiency=_fraction(d, "gemm_max_efficiency", where, file, default=0.8),
            attention_fwd_efficiency=_fraction(d, "attention_fwd_efficiency", where, file, default=0.5),
            attention_bwd_efficiency=_fraction(d, "attention_bwd_efficiency", where, file, default=0.4),
            kernel_launch_s=_num(d, "kernel_launch_us", where, file, allow_zero=True, default=4) / 1e6,
            sustained_clock_fraction=_fraction(d, "sustained_clock_fraction", where, file, default=1.0),
            clock_spread=_fraction(d, "clock_spread", where, file, default=0.0, allow_zero=True),
            vendor=str(d.get("vendor", "nvidia")),
            source=str(d.get("source", "")),
            collective_overlap=_fraction(d, "collective_overlap", where, file, default=1.0, allow_zero=True),
            unaligned_gemm_slowdown=max(1.0, _num(d, "unaligned_gemm_slowdown", where, file, default=1.0)),
            host_op_fwd_s=_num(d, "host_op_fwd_us", where, file, allow_zero=True, default=0.0) / 1e6,
            host_op_bwd_s=_num(d, "host_op_bwd_us", where, file, allow_zero=True, default=0.0) / 1e6,
            fsdp_unit_host_s=_num(d, "fsdp_unit_host_us", where, file, allow_zero=True, default=0.0) / 1e6,
            fsdp_tensor_host_s=_num(d, "fsdp_tensor_host_us", where, file, allow_zero=True, default=0.0) / 1e6,
            measured=_measured(d, "compute", where, file),
        )

    def to_dict(self) -> dict:
        return {
            "peak_tflops": {k: v / TERA for k, v in sorted(self.peak_flops.items())},
            "memory_gib": self.memory_bytes / GIB,
            "memory_bandwidth_tbs": self.memory_bandwidth / TERA,
            "memory_efficiency": self.memory_efficiency,
            "reserve_gib": self.reserve_bytes / GIB,
            "num_sms": self.num_sms,
            "gemm_max_efficiency": self.gemm_max_efficiency,
            "attention_fwd_efficiency": self.attention_fwd_efficiency,
            "attention_bwd_efficiency": self.attention_bwd_efficiency,
            "kernel_launch_us": round(self.kernel_launch_s * 1e6, 9),  # round: from_dict(to_dict()) is exact
            "sustained_clock_fraction": self.sustained_clock_fraction,
            "clock_spread": self.clock_spread,
            "vendor": self.vendor,
            "source": self.source,
            "collective_overlap": self.collective_overlap,
            "unaligned_gemm_slowdown": self.unaligned_gemm_slowdown,
            "host_op_fwd_us": round(self.host_op_fwd_s * 1e6, 9),
            "host_op_bwd_us": round(self.host_op_bwd_s * 1e6, 9),
            "fsdp_unit_host_us": round(self.fsdp_unit_host_s * 1e6, 9),
            "fsdp_tensor_host_us": round(self.fsdp_tensor_host_s * 1e6, 9),
            **({"measured": self.measured.to_dict()} if self.measured is not None else {}),
        }


@dataclass(frozen=True)
class LinkProfile:
    """One interconnect tier, seen from one GPU."""

    name: str
    bandwidth: float  # B/s per GPU per direction, peak
    bus_efficiency: float  # nccl-tests busbw / peak on large messages
    latency_s: float  # alpha: one ring/tree step
    source: str = ""
    measured: Any = None  # collectives timed by `autopar calibrate` (cost_models/measured.py)

    @property
    def bus_bandwidth(self) -> float:
        """What a ring collective's bus bandwidth reaches on this tier (B/s)."""
        return self.bandwidth * self.bus_efficiency

    @classmethod
    def from_dict(cls, name: str, d: dict, file: str = "<dict>") -> "LinkProfile":
        where = f"links.{name}"
        d = _mapping(d, where, file)
        return cls(
            name=name,
            bandwidth=_num(d, "bandwidth_gbs", where, file) * GIGA,
            bus_efficiency=_fraction(d, "bus_efficiency", where, file, default=0.8),
            latency_s=_num(d, "latency_us", where, file, allow_zero=True) / 1e6,
            source=str(d.get("source", "")),
            measured=_measured(d, "collectives", where, file),
        )

    def to_dict(self) -> dict:
        return {"bandwidth_gbs": self.bandwidth / GIGA, "bus_efficiency": self.bus_efficiency,
                "latency_us": round(self.latency_s * 1e6, 9), "source": self.source,
                **({"measured": self.measured.to_dict()} if self.measured is not None else {})}


def _measured(d: dict, kind: str, where: str, file: str):
    """A profile's measured tables carried inside a device or link entry (a plan's cluster)."""
    if d.get("measured") is None:
        return None
    from cost_models import measured

    cls = measured.MeasuredCompute if kind == "compute" else measured.MeasuredCollectives
    return cls.from_dict(d["measured"], file, f"{where}.measured")


# -- shipped profiles ------------------------------------------------------------
def _load_yaml(path: Path | str) -> dict:
    path = str(path)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ProfileError(f"cannot read profile file: {exc.strerror}", file=path) from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise ProfileError(f"not valid {'JSON' if path.endswith('.json') else 'YAML'}: {exc}", file=path) from None
    if not isinstance(data, dict):
        raise ProfileError("top level must be a mapping", file=path)
    return data


def load_devices(path: Path | str) -> dict[str, DeviceProfile]:
    data = _load_yaml(path)
    section = _mapping(data.get("devices"), "devices", str(path))
    return {name: DeviceProfile.from_dict(name, d, str(path)) for name, d in section.items()}


def load_links(path: Path | str) -> dict[str, LinkProfile]:
    data = _load_yaml(path)
    section = _mapping(data.get("links"), "links", str(path))
    return {name: LinkProfile.from_dict(name, d, str(path)) for name, d in section.items()}


@lru_cache(maxsize=None)
def shipped_devices() -> dict[str, DeviceProfile]:
    return load_devices(PROFILE_DIR / "devices.yaml")


@lru_cache(maxsize=None)
def shipped_links() -> dict[str, LinkProfile]:
    return load_links(PROFILE_DIR / "links.yaml")


@lru_cache(maxsize=None)
def shipped_clusters() -> dict[str, dict]:
    path = PROFILE_DIR / "clusters.yaml"
    return dict(_mapping(_load_yaml(path).get("clusters"), "clusters", str(path)))


def _lookup(kind: str, name: str, shipped: dict, extra: dict | None, file: str | None, field: str):
    # User-defined profiles (from a cluster file) shadow the shipped ones.
    if extra and name in extra:
        return extra[name]
    if name not in shipped:
        known = ", ".join(sorted(shipped) + sorted(extra or {}))
        raise ProfileError(f"unknown {kind} '{name}' (known: {known})", field=field, file=file)
    return shipped[name]


def get_device(name: str, extra: dict | None = None, *, file: str | None = None, field: str = "device") -> DeviceProfile:
    """A device profile by name (`extra` holds user-defined ones, checked first)."""
    return _lookup("device", name, shipped_devices(), extra, file, field)


def get_link(name: str, extra: dict | None = None, *, file: str | None = None, field: str = "link") -> LinkProfile:
    """A link profile by name (`extra` holds user-defined ones, checked first)."""
    return _lookup("link", name, shipped_links(), extra, file, field)


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
                self.host_memory_bytes, self.host_link, self.host_memory_bandwidth, custom)

    def with_profile(self, profile) -> "ClusterSpec":
        """This cluster priced with a measured profile (`autopar calibrate`'s file,
        a path or a cost_models.measured.Profile): its device and links replace ours."""
        from cost_models.measured import Profile, apply_profile

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
        return d

    @classmethod
    def from_dict(cls, d: dict, file: str = "<dict>") -> "ClusterSpec":
        d = _mapping(d, "cluster", file)
        devices = {n: DeviceProfile.from_dict(n, v, file) for n, v in _mapping(d.get("devices", {}), "devices", file).items()}
        links = {n: LinkProfile.from_dict(n, v, file) for n, v in _mapping(d.get("links", {}), "links", file).items()}
        body = d.get("cluster", d)
        body = _mapping(body, "cluster", file)
        base: dict = {}
        if "preset" in body:  # start from a preset, override what the file gives
            base = dict(_preset_body(_str(body, "preset", "cluster", file), file))
        merged = {**base, **{k: v for k, v in body.items() if k != "preset"}}
        known = {"name", "nodes", "gpus_per_node", "device", "intra_node_link", "inter_node_link",
                 "host_memory_gib", "host_memory_bytes", "host_link", "host_memory_bandwidth_gbs", "world_size"}
        unknown = sorted(set(merged) - known - {"devices", "links", "cluster"})
        if unknown:
            raise ProfileError(f"unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})",
                               field=unknown[0], file=file)
        if "host_memory_bytes" in merged:
            host_mem = _num(merged, "host_memory_bytes", "cluster", file)
        else:
            host_mem = _num(merged, "host_memory_gib", "cluster", file, default=2048) * GIB
        nodes = merged.get("nodes", 1)
        gpn = merged.get("gpus_per_node", 8)
        spec = cls(
            nodes=nodes,
            gpus_per_node=gpn,
            device=_str(merged, "device", "cluster", file),
            intra_node_link=_str(merged, "intra_node_link", "cluster", file, default="nvlink4"),
            inter_node_link=_str(merged, "inter_node_link", "cluster", file, default="ib-ndr"),
            host_memory_bytes=host_mem,
            host_link=_str(merged, "host_link", "cluster", file, default="pcie5"),
            host_memory_bandwidth=_num(merged, "host_memory_bandwidth_gbs", "cluster", file, default=500) * GIGA,
            name=merged.get("name"),
            devices=devices,
            links=links,
            source=file,
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
        return cls.from_dict(_load_yaml(path), file=path)

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
