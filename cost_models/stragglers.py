"""The slowest GPU sets the pace of a synchronous job.

Two GPUs of the same model do not sustain the same clock: silicon lottery
(each die's voltage-frequency curve) and cooling position give each GPU its
own saturated clock under a power limit. A training step is synchronous over
the whole job (tensor-parallel collectives every layer, pipeline transfers,
one data-parallel reduction per step), so every rank waits, every step, for
the slowest GPU. With per-GPU sustained speed ~ Normal(mean, sigma) the
slowest of N runs at mean x (1 - sigma x z(N)), where z(N) is the expected
maximum of N standard normals (z(8) = 1.42, z(512) = 3.04, z(16384) = 3.95).

sigma is the device profile's `clock_spread`, from a published measurement
of performance variation across the same-SKU GPUs of whole production
clusters (Sinha et al., "Not All GPUs Are Created Equal", SC'22, arXiv
2208.11035: 8% on average, read as the fastest-to-slowest spread over
N ~ 25,000 GPUs -> sigma = 8% / (2 z(N)) = 1.0%; see profiles/devices.yaml).
The per-kernel constants (MAMF, sustained clocks) are per-GPU means, so this
is the only place the spread enters.
"""
from __future__ import annotations

import math
from functools import lru_cache


@lru_cache(maxsize=1024)
def expected_max_normal(n: int) -> float:
    """E[max of n iid standard normals] (0 for n = 1), by integrating 1 - F(x)^n."""
    n = int(n)
    if n <= 1:
        return 0.0
    # E[max] = int_0^inf (1 - F^n) dx - int_-inf^0 F^n dx, on a fine grid (x in [-8, 8])
    step, total = 1e-3, 0.0
    for i in range(16000):
        x = -8.0 + (i + 0.5) * step
        cdf = 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
        total += (1.0 - cdf**n) if x > 0 else -(cdf**n)
    return total * step


def slowest_gpu_slowdown(world_size: int, clock_spread: float) -> float:
    """Time factor (>= 1) of compute paced by the slowest of `world_size` GPUs."""
    if world_size <= 1 or clock_spread <= 0:
        return 1.0
    pace = 1.0 - clock_spread * expected_max_normal(world_size)
    return 1.0 / max(pace, 0.5)
