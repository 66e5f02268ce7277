"""`autopar calibrate`: time this machine and write a measured profile.

The stage as a folder: `timing` (settings, the timer, rotated operands),
`host_overhead` (host time per op, DTensor, pipelining), `compute` (GEMMs,
memory-bound ops, optimizer, attention), `communication` (collectives,
overlap, FSDP2), `workers` (one process per rank, the phases in order) and
`profile_file` (the tables as a measured profile).

What is timed, each on the device and backend training will use:
- the host time of one eager op forward and one autograd node backward
  (a chain of tiny ops; what a small op costs whatever its size);
- GEMMs on a grid of (m, n, k) per dtype;
- memory-bound ops by name (add, mul, gelu, silu, exp, layer norm, softmax,
  log-softmax, copy, embedding gather) from cache-sized to memory-sized tensors;
- the optimizer step of torch's default AdamW and SGD on this device, as
  seconds per step, per parameter tensor and per element;
- the host time DTensor takes per op under tensor parallelism: toy Llama
  blocks split by autopar's own TP lowering, on a one-rank mesh (host work
  alone), then over every rank (what each of their collectives costs beyond
  a plain one);
- scaled_dot_product_attention forward and backward, causal and full;
- collectives (all-reduce, all-gather, reduce-scatter, broadcast, all-to-all,
  point-to-point) by size over every power-of-two group up to `ranks`;
- the host time torch.distributed.pipelining adds per schedule action.

Each table holds the rate of the work alone: the dispatch time of a call
(timed first, with autograd off) is taken out, and the cost model charges
host time per op a layer dispatches, views included (eager with autograd, or
DTensor under tensor parallelism). A profile therefore reproduces each
measured point, and the cost model's job is what lies between the points
(cost_models/measured.py).

On a CPU, `ranks` processes share the machine while training, so every rank
runs the same benchmark at the same time (barrier before each point) with
its share of the cores, and rank 0's timing is what one rank gets. On GPUs
each rank owns a device.
"""
from __future__ import annotations

from autopar.calibrate.communication import measure_fsdp, measure_overlap
from autopar.calibrate.compute import (measure_attention, measure_gemm, measure_gemm_unaligned, measure_ops,
                                       measure_optimizer)
from autopar.calibrate.host_overhead import (measure_dtensor_overhead, measure_overhead, measure_pipeline_action,
                                             measure_tp_collective_overhead)
from autopar.calibrate.profile_file import build_profile
from autopar.calibrate.timing import Settings, Timer, grids, interleaved, speed_probe
from autopar.calibrate.workers import calibrate
from autopar.precision import DTYPES

__all__ = ["DTYPES", "Settings", "Timer", "build_profile", "calibrate", "grids", "interleaved", "measure_attention",
           "measure_dtensor_overhead", "measure_fsdp", "measure_gemm", "measure_gemm_unaligned", "measure_ops",
           "measure_optimizer", "measure_overhead", "measure_overlap", "measure_pipeline_action",
           "measure_tp_collective_overhead", "speed_probe"]
