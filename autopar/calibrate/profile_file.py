"""The measured profile written from a calibration run's tables
(cost_models/measured.py reads it)."""
from __future__ import annotations

from dataclasses import asdict
import platform
import socket
import sys
import time

import torch

from autopar.calibrate.timing import Settings
from cost_models.measured import SCHEMA, MeasuredCollectives, MeasuredCompute, Profile


def build_profile(result: dict, settings: Settings) -> Profile:
    """The profile file from the raw timings: the tables, and the device fields
    derived from them (best GEMM rate as the peak, best copy rate as bandwidth)."""
    gemm = result["gemm"]
    # the largest GEMM timed sets the peak (small ones' rates are the work after the
    # dispatch time is taken out: noisy, and not what a peak means)
    peaks = {dt: t["flops_per_s"][-1] / 1e12 for dt, t in gemm.items()}
    if "bf16" in peaks:
        peaks.setdefault("fp16", peaks["bf16"])
    bandwidth = result["bandwidth"]["copy"]["bytes_per_s"][-1]  # streaming, beyond the caches
    attention_peak = max(a["flops_per_s"][-1] for a in result["attention"] if a["direction"] == "fwd")
    attention_bwd = max(a["flops_per_s"][-1] for a in result["attention"] if a["direction"] == "bwd")
    top = max(peaks.values()) * 1e12
    if settings.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, memory, sms, vendor, reserve = (props.name, props.total_memory / 2**30, props.multi_processor_count,
                                              "nvidia", 1.5)
    else:
        name, sms, vendor, reserve = platform.processor() or platform.machine(), settings.threads(), "cpu", 0.5
        memory = _host_memory_gib() / settings.ranks
    device_name = f"measured-{settings.device}"
    device = {
        "vendor": vendor, "peak_tflops": peaks, "memory_gib": round(memory, 2),
        "memory_bandwidth_tbs": bandwidth / 1e12, "memory_efficiency": 1.0, "reserve_gib": reserve,
        "num_sms": int(sms), "gemm_max_efficiency": 1.0,
        "attention_fwd_efficiency": min(1.0, attention_peak / top),
        "attention_bwd_efficiency": min(1.0, attention_bwd / top),
        "kernel_launch_us": result["overhead"]["fwd"] * 1e6,
        **({"collective_overlap": result["collective_overlap"]} if result["collective_overlap"] is not None else {}),
        "source": f"autopar calibrate on {socket.gethostname()} ({name})",
    }
    compute = {"gemm": gemm, "bandwidth": result["bandwidth"], "attention": result["attention"],
               "gemm_unaligned": result["gemm_unaligned"],
               "op_overhead_fwd_s": result["overhead"]["fwd"], "op_overhead_bwd_s": result["overhead"]["bwd"],
               "op_overhead_no_grad_s": result["overhead"]["no_grad"], "optimizer": result["optimizer"],
               "dtensor_overhead_fwd_s": result["overhead"]["dtensor_fwd"],
               "dtensor_overhead_bwd_s": result["overhead"]["dtensor_bwd"],
               **({"dtensor_by_activation": result["overhead"]["by_activation"]}
                  if result["overhead"].get("by_activation") else {}),
               **({"fsdp": result["fsdp"]} if result["fsdp"] else {}),
               "dtensor_collective_overhead_s": result["funcol"],
               "pipeline_action_s": result.get("pipeline_action", 0.0)}
    machine = {"host": socket.gethostname(), "processor": name, "torch": torch.__version__,
               "python": sys.version.split()[0], "backend": settings.backend, "ranks": settings.ranks,
               "threads_per_rank": settings.threads() if settings.device == "cpu" else None,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "settings": asdict(settings),
               **({"speed_probe_s": result["speed_probe_s"]} if result.get("speed_probe_s") else {})}
    data = {"schema": SCHEMA, "machine": machine, "device_name": device_name, "device": device,
            "compute": compute, "collectives": {"intra_node": result["collectives"]} if result["collectives"] else {}}
    profile = Profile.from_dict(data, "<autopar calibrate>")
    assert isinstance(profile.compute, MeasuredCompute)
    assert all(isinstance(c, MeasuredCollectives) for c in profile.collectives.values())
    return profile



def _host_memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 16.0

