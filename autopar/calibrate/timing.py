"""How calibration times things: the settings and grids, the timer (host or
kernel time, barriers between ranks), and operands rotated through memory so
no point is timed from a warm cache."""
from __future__ import annotations

from dataclasses import dataclass
import os
import statistics
import time

import torch


SILENCE_LIMIT_S = 900.0  # every phase reports well within this; longer means a rank is stuck



@dataclass
class Settings:
    device: str = "cpu"  # 'cpu' or 'cuda'
    ranks: int = 2  # ranks sharing one node while training (CPU) / GPUs to time collectives over
    threads_per_rank: int | None = None  # CPU: default cores // ranks
    dtypes: tuple = ("fp32", "bf16")
    quick: bool = False  # a small grid (tests, a first look): minutes become seconds
    min_sample_s: float = 0.02  # one timing sample lasts at least this long
    repeats: int = 5  # samples per point; the median is kept (shared CPUs are noisy)

    def __post_init__(self):
        if self.quick:  # a first look: shorter, fewer samples
            self.min_sample_s, self.repeats = 0.005, 3

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"

    def threads(self) -> int:
        return self.threads_per_rank or max(1, (os.cpu_count() or 1) // self.ranks)



def grids(settings: Settings) -> dict:
    """Sizes timed, by what training on this kind of device sees."""
    if settings.device == "cuda":
        g = {"gemm_m": [256, 1024, 4096, 16384, 65536], "gemm_nk": [256, 1024, 4096, 8192, 16384],
             "elements": [2**14, 2**18, 2**22, 2**26], "attn_seq": [512, 1024, 2048, 4096, 8192, 16384],
             "attn_heads": 16, "attn_dim": 128, "coll_bytes": [2**12, 2**16, 2**20, 2**24, 2**28]}
    else:
        g = {"gemm_m": [16, 64, 256, 1024, 4096], "gemm_nk": [16, 64, 256, 1024],
             "elements": [2**10, 2**13, 2**16, 2**19, 2**22], "attn_seq": [16, 64, 256, 1024],
             # 16 sequences a call, as a training call's batch x heads holds (4 x 4, 2 x 8):
             # at s = 128 one core ran 4 of them 20% faster per FLOP than 16 (their q, k and
             # v fit a core's L2), which priced a step's attention 20% fast
             "attn_heads": 16, "attn_dim": 64, "coll_bytes": [2**10, 2**13, 2**16, 2**19, 2**22, 2**25]}
    if settings.quick:
        g = {k: (v[::2] if isinstance(v, list) else v) for k, v in g.items()}
    return g



# -- timing ---------------------------------------------------------------------------
class Timer:
    def __init__(self, settings: Settings, device: torch.device, barrier=None):
        self.settings, self.device, self.barrier = settings, device, barrier

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn, inner: int | None = None) -> float:
        """Median seconds of one call of fn (warmed up; inner loops keep a sample long
        enough). Collectives pass `inner`: every rank must call them equally often."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        one = max(time.perf_counter() - t0, 1e-7)
        if inner is None:
            inner = max(1, min(10_000, int(self.settings.min_sample_s / one)))
        return self.samples({"fn": fn}, inner, self.settings.repeats)["fn"]

    # No GPU clock runs above this (H100 / H200 boost at 1.98 GHz): a sleep of
    # seconds x this many cycles lasts at least that long
    GPU_CYCLES_PER_S = 2.0e9

    def kernel(self, fn) -> float:
        """Median GPU seconds of one call's kernels (CUDA only).

        A GPU runs a call's kernels while the host is already launching the next call,
        so a timed loop measures the larger of the two, not their sum: taking the host's
        time per op out of it (as a CPU's serial timings rightly do) priced every call
        shorter than its launch as absurdly fast (on an H200: a 33 MB gelu at 30 TB/s,
        six times the HBM's 4.8). Here the calls are queued behind a sleeping kernel
        that outlasts their launching, and CUDA events time the GPU running them back
        to back: the kernels' own time. The cost model charges host time apart, per
        op, and takes a layer's larger of the two."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        one = max(time.perf_counter() - t0, 1e-7)  # host or kernels, whichever is longer
        inner = max(1, min(64, int(self.settings.min_sample_s / one)))  # 64 calls: the launch queue holds them
        # launching a call takes at most its one-call time, and never more than 200 us
        # (a backward's few kernels): past that the kernels outlast the launches anyway
        sleep_cycles = int(1.5 * inner * min(one, 2e-4) * self.GPU_CYCLES_PER_S)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(self.settings.repeats):
            torch.cuda._sleep(sleep_cycles)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        return statistics.median(samples)

    def samples(self, fns: dict, inner: int, repeats: int) -> dict:
        """Median seconds per call of each fn, sampled in turn (A B C A B C ...), a
        barrier before each sample so every rank times the same work at the same moment."""
        samples: dict = {k: [] for k in fns}
        for _ in range(repeats):
            for k, fn in fns.items():
                if self.barrier is not None:
                    self.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                self.sync()
                samples[k].append((time.perf_counter() - t0) / inner)
        return {k: statistics.median(v) for k, v in samples.items()}



def interleaved(timer: Timer, fns: dict, inner: int, repeats: int = 9) -> dict:
    """Median seconds per call of each fn (warmed up), sampled in turn: for quantities
    taken as differences, slow drifts of a shared machine hit every fn alike instead
    of one of them."""
    for fn in fns.values():
        fn()
    timer.sync()
    return timer.samples(fns, inner, repeats)



# One fixed piece of work in a transformer step's proportions: a feed-forward pair of
# GEMMs with gelu between, and a vocabulary-wide log_softmax. (tokens, hidden, ffn, vocab)
_PROBE_SHAPES = {"cpu": (512, 256, 1024, 2048), "cuda": (8192, 4096, 16384, 32768)}



def speed_probe(device: torch.device | str = "cpu", samples: int = 9, barrier=None) -> float:
    """Median seconds of the probe's work (no autograd), timed now.

    A shared machine (a VM, a node with neighbours) runs faster or slower from one
    minute to the next: on this project's 2-core VM the same training step took
    108 ms and 132 ms twenty minutes apart, and micro-benchmarks drift with it.
    A profile records the probe's time while it was measured
    (`machine["speed_probe_s"]`); a benchmark that times the probe beside its steps
    knows how fast the machine ran then, relative to the profile, and can compare
    a prediction with a step at the same speed. The probe is the same work on
    every call: it says nothing about any model, only about the machine's pace."""
    device = torch.device(device)
    tokens, hidden, ffn, vocab = _PROBE_SHAPES["cuda" if device.type == "cuda" else "cpu"]
    gen = torch.Generator().manual_seed(0)
    x, w1, w2, z = (torch.randn(*shape, generator=gen).to(device)
                    for shape in ((tokens, hidden), (hidden, ffn), (ffn, hidden), (tokens, vocab)))

    def work():
        torch.mm(torch.nn.functional.gelu(torch.mm(x, w1)), w2)
        torch.log_softmax(z, -1)

    with torch.no_grad():
        return interleaved(Timer(Settings(device=device.type), device, barrier), {"probe": work},
                           inner=4, repeats=samples)["probe"]



def _work_seconds(timer: Timer, fn, overhead: float) -> float:
    """Seconds of fn's own work per call, its host dispatch excluded, because the cost
    model charges host time per dispatched op of a layer (every op, views included).
    A CPU does the two in turn: the call's time less its dispatch (`overhead`, timed
    with autograd off), never less than 10% of it (a call is some work). A GPU
    overlaps them: its kernels' own time (Timer.kernel)."""
    if timer.device.type == "cuda":
        return timer.kernel(fn)
    seconds = timer(fn)
    return max(seconds - overhead, 0.1 * seconds)



def _work_rate(work: float, timer: Timer, fn, overhead: float) -> float:
    return work / _work_seconds(timer, fn, overhead)



def _copies(nbytes_each: int, device: torch.device) -> int:
    """How many buffers of nbytes_each, used in turn, keep each out of the caches a
    training step's working set overflows: 128 MiB in all on a CPU, 256 MiB on a GPU
    (beyond its L2). On this project's VM (2 MiB of L2 a core, a shared L3 it reports
    as 480 MiB) memory-bound ops slow down until the pool passes 64 MiB and no further
    (an add of 2 MiB: 0.20 ms cycling 16 MiB, 0.36 ms at 64 MiB, 0.34 ms at 1 GiB), and
    ran in a step at the 64 MiB+ speed; a 16 MiB pool priced them up to 40% fast."""
    pool = (256 if device.type == "cuda" else 128) * 2**20
    return max(2, min(64, -(-pool // max(1, nbytes_each))))



def _rotating(make, nbytes_each: int, device: torch.device) -> list:
    """Enough distinct copies of a call's operands that cycling through them keeps
    them out of the caches (a training step's operands were written by another op or
    read a step ago, never the buffer just read). Copies of one random draw: drawing
    each afresh costs seconds per point at these pool sizes."""
    first = make()
    return [first] + [tuple(t.clone() for t in first) for _ in range(_copies(nbytes_each, device) - 1)]



def _cycling(fn, operands: list, keep: int = 0):
    """A call of fn on the next operands in turn. With `keep`, the last `keep` results
    stay alive, so each result is written to memory last touched `keep` calls ago, as
    a training step writes an op's output to a buffer freed long before (the caching
    allocator's or malloc's, cold in the core's caches). A result freed and written
    again at once stays in cache: on one CPU core a 512 x 2048 log_softmax then ran in
    0.73 ms where it takes 1.1-1.3 ms in a step."""
    state, results = [0, 0], [None] * keep

    def call():
        state[0] = (state[0] + 1) % len(operands)
        out = fn(*operands[state[0]])
        if keep:
            state[1] = (state[1] + 1) % keep
            results[state[1]] = out
        return out
    if keep:
        for _ in range(keep):  # the pool of kept results allocated before timing
            call()
    return call

