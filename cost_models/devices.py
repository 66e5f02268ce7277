"""Device and link profiles: one accelerator's numbers, one interconnect tier's,
and the shipped ones (`cost_models/profiles/devices.yaml`, `links.yaml`,
`clusters.yaml`), with the source of every figure next to it.

A profile may carry what `autopar calibrate` measured (measured_tables.py);
ClusterSpec (hardware.py) joins a device and its links into a cluster.
Units are SI: FLOP/s, bytes, bytes/s, seconds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from cost_models.errors import CostModelError, ProfileError
from cost_models.fields import read_fraction, read_mapping, read_number
from cost_models.measured_tables import MeasuredCollectives, MeasuredCompute

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
GIB = 1024**3
TERA = 1e12
GIGA = 1e9


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
    # what `autopar calibrate` timed on this device (cost_models/measured_tables.py); when set,
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
        d = read_mapping(d, where, file)
        peaks = read_mapping(d.get("peak_tflops"), f"{where}.peak_tflops", file) if "peak_tflops" in d else None
        if not peaks:
            raise ProfileError("missing required field (dense TFLOP/s per dtype)", field=f"{where}.peak_tflops", file=file)
        peak_flops = {str(k): read_number(peaks, k, f"{where}.peak_tflops", file) * TERA for k in peaks}
        memory = read_number(d, "memory_gib", where, file) * GIB
        reserve = read_number(d, "reserve_gib", where, file, allow_zero=True, default=1.0) * GIB
        if reserve >= memory:
            raise ProfileError(f"reserve ({reserve / GIB} GiB) must be below memory_gib", field=f"{where}.reserve_gib", file=file)
        return cls(
            name=name,
            peak_flops=peak_flops,
            memory_bytes=memory,
            memory_bandwidth=read_number(d, "memory_bandwidth_tbs", where, file) * TERA,
            memory_efficiency=read_fraction(d, "memory_efficiency", where, file, default=0.85),
            reserve_bytes=reserve,
            num_sms=int(read_number(d, "num_sms", where, file, default=108)),
            gemm_max_efficiency=read_fraction(d, "gemm_max_efficiency", where, file, default=0.8),
            attention_fwd_efficiency=read_fraction(d, "attention_fwd_efficiency", where, file, default=0.5),
            attention_bwd_efficiency=read_fraction(d, "attention_bwd_efficiency", where, file, default=0.4),
            kernel_launch_s=read_number(d, "kernel_launch_us", where, file, allow_zero=True, default=4) / 1e6,
            sustained_clock_fraction=read_fraction(d, "sustained_clock_fraction", where, file, default=1.0),
            clock_spread=read_fraction(d, "clock_spread", where, file, default=0.0, allow_zero=True),
            vendor=str(d.get("vendor", "nvidia")),
            source=str(d.get("source", "")),
            collective_overlap=read_fraction(d, "collective_overlap", where, file, default=1.0, allow_zero=True),
            unaligned_gemm_slowdown=max(1.0, read_number(d, "unaligned_gemm_slowdown", where, file, default=1.0)),
            host_op_fwd_s=read_number(d, "host_op_fwd_us", where, file, allow_zero=True, default=0.0) / 1e6,
            host_op_bwd_s=read_number(d, "host_op_bwd_us", where, file, allow_zero=True, default=0.0) / 1e6,
            fsdp_unit_host_s=read_number(d, "fsdp_unit_host_us", where, file, allow_zero=True, default=0.0) / 1e6,
            fsdp_tensor_host_s=read_number(d, "fsdp_tensor_host_us", where, file, allow_zero=True, default=0.0) / 1e6,
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
    measured: Any = None  # collectives timed by `autopar calibrate` (cost_models/measured_tables.py)

    @property
    def bus_bandwidth(self) -> float:
        """What a ring collective's bus bandwidth reaches on this tier (B/s)."""
        return self.bandwidth * self.bus_efficiency

    @classmethod
    def from_dict(cls, name: str, d: dict, file: str = "<dict>") -> "LinkProfile":
        where = f"links.{name}"
        d = read_mapping(d, where, file)
        return cls(
            name=name,
            bandwidth=read_number(d, "bandwidth_gbs", where, file) * GIGA,
            bus_efficiency=read_fraction(d, "bus_efficiency", where, file, default=0.8),
            latency_s=read_number(d, "latency_us", where, file, allow_zero=True) / 1e6,
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
    cls = MeasuredCompute if kind == "compute" else MeasuredCollectives
    return cls.from_dict(d["measured"], file, f"{where}.measured")


# -- shipped profiles ------------------------------------------------------------
def load_profile_file(path: Path | str) -> dict:
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
    data = load_profile_file(path)
    section = read_mapping(data.get("devices"), "devices", str(path))
    return {name: DeviceProfile.from_dict(name, d, str(path)) for name, d in section.items()}


def load_links(path: Path | str) -> dict[str, LinkProfile]:
    data = load_profile_file(path)
    section = read_mapping(data.get("links"), "links", str(path))
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
    return dict(read_mapping(load_profile_file(path).get("clusters"), "clusters", str(path)))


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


# What torch.cuda.get_device_name() says -> the profile's name, most specific first
_GPU_NAMES = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("B200", "b200"),
              ("A100-SXM4-40GB", "a100-40g"), ("A100-PCIE-40GB", "a100-40g"), ("A100", "a100-80g"),
              ("V100", "v100-32g"), ("MI300X", "mi300x"))


def device_for_gpu_name(name: str) -> str | None:
    """The shipped profile for a GPU as torch names it ('NVIDIA H100 80GB HBM3' -> 'h100-sxm');
    None for a GPU without one."""
    for part, device in _GPU_NAMES:
        if part.lower() in (name or "").lower():
            return device
    return None

