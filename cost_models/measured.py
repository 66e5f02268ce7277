"""Measured profiles: what `autopar calibrate` timed on a machine, as tables
the cost model reads in place of the physics defaults.

A profile is a versioned JSON file (never pickled) with three parts:

- `device`: the fields of a device profile (devices.yaml) derived from the
  measurements: the largest GEMM's rate as the peak, the largest copy's rate
  as memory bandwidth, eager host time per op as the launch floor, and the
  share of a collective that hides under compute (`collective_overlap`);
- `compute`: tables, each a measurement of one kind of work, dispatch time
  taken out (the cost model charges host time per op a layer dispatches):
    gemm       FLOP/s on a grid of (m, n, k) per dtype (trilinear in log2)
    bandwidth  bytes/s of memory-bound ops by name and by class, by bytes
               per call (log-log); `NAME.bwd`: the op's backward kernels
    attention  FLOP/s of scaled_dot_product_attention, forward and backward,
               causal and full, by FLOPs per call (counted unmasked, as the
               workload counts them); with `seq` (the sequence length of
               each point), by sequence length: the rate of a kernel's tiles
               along the sequence, whatever the batch x heads it runs over
    op_overhead_*, dtensor_overhead_*  host time per dispatched op: eager
               forward with autograd, backward, forward without autograd;
               DTensor forward and backward
    dtensor_by_activation  DTensor's time per op (eager's own included) by the
               bytes of the activation the blocks carried: toy blocks on a
               one-rank mesh less the same plain blocks, per op
    optimizer  seconds per step, per parameter tensor and per element of
               torch's default AdamW / SGD, plain and on DTensor shards
    fsdp       FSDP2's seconds per all-gather and per reduce-scatter of a
               unit, collectives included, by unit bytes
    pipeline_action_s  host seconds torch.distributed.pipelining adds to
               each schedule action (a stage's forward or backward of one
               micro-batch), beyond the stage's work and its transfers
- `collectives`: seconds by (collective, group size, bytes), measured over
  torch.distributed on the backend the machine trains with.

Interpolation never invents a trend the table does not show: inside a table
it interpolates, beyond the largest size it extends the last measured
bandwidth (time grows with bytes or FLOPs at the largest size's rate), below
the smallest it keeps the smallest size's time as a floor (small work is
bound by fixed costs, not by its size). A group size that was not measured
is priced by the ring formula with the latency and bus bandwidth fitted to
the largest measured group (cost_models/comm.py's physics).

This module never imports autopar; `autopar calibrate` writes the files.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from cost_models.devices import DeviceProfile
from cost_models.errors import ProfileError
from cost_models.fields import read_mapping
from cost_models.measured_tables import (COLLECTIVE_KINDS, GemmGrid, MeasuredCollectives,  # noqa: F401 - the tables
                                         MeasuredCompute, ring_terms, time_for_size)

SCHEMA = "autopar-profile/1"


# -- the profile file -------------------------------------------------------------------
@dataclass
class Profile:
    """One machine's measurements (see the module docstring)."""

    device_name: str
    device: dict  # devices.yaml fields derived from the measurements
    compute: MeasuredCompute
    collectives: dict = field(default_factory=dict)  # 'intra_node' | 'inter_node' -> MeasuredCollectives
    machine: dict = field(default_factory=dict)  # where and how it was measured (informational)
    source: str = "<dict>"

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "machine": self.machine, "device_name": self.device_name, "device": self.device,
                "compute": self.compute.to_dict(),
                "collectives": {tier: c.to_dict() for tier, c in sorted(self.collectives.items())}}

    def save(self, path: str) -> None:
        import os
        import tempfile

        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:  # written whole, then renamed: never a half-written profile
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, d: dict, file: str = "<dict>") -> "Profile":
        d = read_mapping(d, "profile", file)
        if d.get("schema") != SCHEMA:
            raise ProfileError(f"is {d.get('schema')!r}, this autopar reads {SCHEMA!r} (re-run autopar calibrate)",
                               field="schema", file=file)
        name = d.get("device_name")
        if not isinstance(name, str) or not name:
            raise ProfileError("must be a non-empty string", field="device_name", file=file)
        device = read_mapping(d.get("device"), "device", file)
        DeviceProfile.from_dict(name, device, file)  # validates the derived fields now
        collectives = {}
        for tier, c in read_mapping(d.get("collectives", {}), "collectives", file).items():
            if tier not in ("intra_node", "inter_node"):
                raise ProfileError("tiers are intra_node and inter_node", field=f"collectives.{tier}", file=file)
            collectives[tier] = MeasuredCollectives.from_dict(c, file, f"collectives.{tier}")
        return cls(device_name=name, device=dict(device),
                   compute=MeasuredCompute.from_dict(d.get("compute", {}), file),
                   collectives=collectives, machine=dict(d.get("machine") or {}), source=file)

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise ProfileError(f"cannot read profile file: {exc.strerror}", file=str(path)) from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProfileError(f"not valid JSON: {exc}", file=str(path)) from None
        return cls.from_dict(data, str(path))


def median_profile(profiles: list) -> Profile:
    """One profile from several calibrations of the same machine: every measured number
    the median of its repeats. A shared machine (a VM, a node with neighbours) runs
    slow spells that one calibration can land in; the median of a few, taken at the
    times the work runs, is what the machine does. Entries whose shape differs between
    repeats (a grid one repeat cut short) keep the first profile's."""
    import statistics

    if not profiles:
        raise ValueError("median_profile: no profiles")

    def med(values):
        first = values[0]
        if isinstance(first, dict):
            if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
                return first
            return {k: med([v[k] for v in values]) for k in first}
        if isinstance(first, list):
            if any(not isinstance(v, list) or len(v) != len(first) for v in values):
                return first
            return [med([v[i] for v in values]) for i in range(len(first))]
        if isinstance(first, (int, float)) and not isinstance(first, bool) \
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            # counts (group sizes, grid points) stay integers: the lower median is one of them
            return statistics.median_low(values) if all(isinstance(v, int) for v in values) \
                else statistics.median(values)
        return first

    dicts = [p.to_dict() for p in profiles]
    merged = med(dicts)
    probes = [d["machine"]["speed_probe_s"] for d in dicts if d.get("machine", {}).get("speed_probe_s")]
    merged["machine"] = {**dicts[0].get("machine", {}), "calibrations": len(profiles),
                         **({"speed_probe_s": statistics.median(probes)} if probes else {}),
                         "created": [d.get("machine", {}).get("created") for d in dicts]}
    return Profile.from_dict(merged, profiles[0].source)
