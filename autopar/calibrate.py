"""`autopar calibrate`: time this machine and write a measured profile.

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

import math
import os
import platform
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

from autopar.precision import DTYPES
from cost_models.measured import SCHEMA, MeasuredCollectives, MeasuredCompute, Profile

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


class _TinyBlock(torch.nn.Module):
    """A pre-norm transformer block at toy width: the modules, views and op mix a
    real block dispatches, with no work to speak of, so only host time is left."""

    def __init__(self, d: int = 8, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, s, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class _TinyAttention(torch.nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (torch.nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (w(x).view(b, s, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class _TinyGatedMLP(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(d, 2 * d, bias=False), torch.nn.Linear(d, 2 * d, bias=False)
        self.w2 = torch.nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _TinyTPBlock(torch.nn.Module):
    """A Llama-style block at toy width, attention and MLP as child modules the
    way people write them, so that autopar's own tensor-parallel lowering
    (`parallelize_block`) splits it exactly as it splits a real model's."""

    def __init__(self, d: int = 8, heads: int = 2):
        super().__init__()
        self.attention_norm, self.ffn_norm = torch.nn.RMSNorm(d), torch.nn.RMSNorm(d)
        self.attention, self.feed_forward = _TinyAttention(d, heads), _TinyGatedMLP(d)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


def _dispatched(fn, weigh=lambda func, args, kwargs, out: 1) -> int:
    """The sum of weigh(op) over the aten ops fn dispatches (1 each: how many)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Tally(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            Tally.total += weigh(func, args, kwargs, out)
            return out
    with Tally():
        fn()
    return Tally.total


def _count_ops(fn) -> tuple[int, int]:
    """(forward, backward) aten ops fn dispatches, counted as capture counts them."""
    box = []
    fwd = _dispatched(lambda: box.append(fn()))
    # less the backward of sum, which the chain itself does not have
    return fwd, _dispatched(lambda: box[0].sum().backward()) - 1


def measure_overhead(timer: Timer, device: torch.device) -> dict:
    """Host seconds per dispatched op, eager: a toy transformer block's forward
    with autograd recording, its backward, and its forward with autograd off."""
    blocks = torch.nn.Sequential(*[_TinyBlock() for _ in range(4)]).to(device)
    xb = torch.randn(2, 4, 8, device=device, requires_grad=True)
    n_fwd, n_bwd = _count_ops(lambda: blocks(xb))
    fwd = timer(lambda: blocks(xb))
    fwd_bwd = timer(lambda: blocks(xb).sum().backward())
    with torch.no_grad():
        plain = timer(lambda: blocks(xb))
    # (the sum and its backward are two of the ops timed but not counted: negligible)
    return {"fwd": fwd / n_fwd, "bwd": max(fwd_bwd - fwd, 0.0) / n_bwd, "no_grad": plain / n_fwd}


_TP_BLOCKS = 4


def _tp_blocks(device: torch.device, mesh, width: int = 8, heads: int = 2, tokens: tuple = (2, 4)):
    """Toy Llama blocks (`width`, `heads`, activations of `tokens` = (batch, seq))
    lowered by autopar's tensor parallelism over `mesh`, and the (forward,
    forward + backward) calls to time, run as a training step runs them
    (`tp_region`)."""
    from autopar.lower.tensor_parallel import parallelize_block, probe_blocks, register_cpu_attention_sharding, \
        tp_region

    if device.type == "cpu":
        register_cpu_attention_sharding()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_TinyTPBlock(width, heads) for _ in range(_TP_BLOCKS)]).to(device)
    x = torch.randn(*tokens, width, device=device)
    plain = (model, x.clone().requires_grad_())
    plans = probe_blocks(model, dict(enumerate(model)), (x,))
    import copy
    sharded = copy.deepcopy(model)
    for i, block in enumerate(sharded):
        parallelize_block(block, plans[i], mesh, sequence_parallel=False, first=i == 0, last=i == _TP_BLOCKS - 1)
    xs = x.clone().requires_grad_()

    def fwd():
        with tp_region():
            return sharded(xs)

    def both():
        with tp_region():
            sharded(xs).sum().backward()
    return plain, fwd, both


# Where DTensor's cost per op is also timed with real data: the blocks at width 256 carrying
# 1, 4 and 8 sequences of 128 tokens (CPU). On this VM the cost beyond eager per op grew from
# 25/18 us (toy width, host only) to 37/29 at one sequence and 48/38 at eight; autopar's
# examples/llama.py blocks on a one-rank mesh the same (31/22 -> 52/47). The growth is not
# any op's data moved (the copies DTensor adds are a few MB a step): it is charged as
# measured, per op, by the activation the block carries.
_DTENSOR_SIZES = {"cpu": (256, 4, [(1, 128), (4, 128), (8, 128)]), "cuda": (1024, 8, [(1, 512), (4, 512)])}


def measure_dtensor_overhead(timer: Timer, device: torch.device, one_rank_mesh, eager: dict | None = None) -> dict:
    """Host seconds DTensor takes per op a layer dispatches under tensor
    parallelism: toy Llama blocks lowered by autopar's own TP lowering, on a
    one-rank mesh (DTensor then issues no collective, and all that is left is
    the host work: sharding propagation, redistribution planning, the styles'
    hooks, the wrapped autograd), divided by the ops the same blocks dispatch
    as plain modules, counted as capture counts them. The time per op of a
    lone DTensor op chain (what was timed before) is half of this: it has no
    module hooks, views with shapes, or redistributions.

    With `eager` (measure_overhead's per-op times), also at the sizes of
    `_DTENSOR_SIZES` (the smallest alone when quick): the DTensor blocks less the same plain blocks
    (sampled in turn), per op, plus eager's own time per op, by the bytes of
    the activation the blocks carry (`by_activation`; the toy-width point
    first)."""
    (model, x), fwd, both = _tp_blocks(device, one_rank_mesh)
    n_fwd, n_bwd = _count_ops(lambda: model(x))
    # sampled in turn: the backward is a difference, and on a loaded machine two timings
    # taken one after the other once left it at zero (a profile refuses that)
    t = interleaved(timer, {"fwd": fwd, "both": both}, inner=1)
    out = {"dtensor_fwd": t["fwd"] / n_fwd, "dtensor_bwd": max(t["both"] - t["fwd"], 0.0) / n_bwd}
    if eager is None:
        return out
    # DTensor dispatches each op through eager's own dispatch: never cheaper per op than it
    out = {"dtensor_fwd": max(out["dtensor_fwd"], eager["fwd"]), "dtensor_bwd": max(out["dtensor_bwd"], eager["bwd"])}
    width, heads, sizes = _DTENSOR_SIZES["cuda" if device.type == "cuda" else "cpu"]
    sizes = sizes[:1] if timer.settings.quick else sizes
    table = {"bytes": [float(x.numel() * x.element_size())], "fwd_s": [out["dtensor_fwd"]],
             "bwd_s": [out["dtensor_bwd"]]}
    for tokens in sizes:
        (model, x), fwd, both = _tp_blocks(device, one_rank_mesh, width, heads, tokens)
        t = interleaved(timer, {"dt_fwd": fwd, "dt_both": both, "fwd": lambda: model(x),
                                "both": lambda: model(x).sum().backward()}, inner=1)
        beyond_fwd = max(0.0, t["dt_fwd"] - t["fwd"]) / n_fwd
        beyond_bwd = max(0.0, (t["dt_both"] - t["dt_fwd"]) - (t["both"] - t["fwd"])) / n_bwd
        table["bytes"].append(float(x.numel() * x.element_size()))
        table["fwd_s"].append(eager["fwd"] + beyond_fwd)
        table["bwd_s"].append(eager["bwd"] + beyond_bwd)
    out["by_activation"] = table
    return out


def measure_tp_collective_overhead(timer: Timer, device: torch.device, mesh, one_rank_mesh) -> float:
    """Seconds each collective of a tensor-parallel block costs beyond a plain
    c10d all-reduce of the same tiny size: the same toy blocks over every rank
    less over a one-rank mesh, per collective they issue (counted with
    CommDebugMode), less as many plain all-reduces, the three sampled in turn
    (a difference of timings). What is left is DTensor's functional-collective
    path and the ranks meeting at each collective after host work of their own
    (on CPU ranks sharing cores: 1-3x the plain all-reduce)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    _, _, one = _tp_blocks(device, one_rank_mesh)
    _, _, world = _tp_blocks(device, mesh)
    counter = CommDebugMode()
    with counter:
        world()
    n = counter.get_total_counts()
    if n == 0:
        return 0.0
    t = torch.ones(2 * 4 * 8, device=device)  # the blocks' activation
    group = mesh.get_group()

    def plain():
        for _ in range(n):
            dist.all_reduce(t, group=group)
    # every rank the same number of calls: the blocks communicate
    got = interleaved(timer, {"world": world, "one": one, "plain": plain}, inner=4,
                      repeats=max(9, timer.settings.repeats))
    return max(0.0, (got["world"] - got["one"] - got["plain"]) / n)


def measure_pipeline_action(timer: Timer, device: torch.device) -> float:
    """Host seconds torch.distributed.pipelining adds per schedule action: a
    2-stage Schedule1F1B of tiny stages on ranks 0 and 1 (the others keep the
    barriers company), timed at 4 and 16 micro-batches. The cost model's own
    schedule simulation (cost_models.pipeline), given the stages' measured
    forward and backward and one transfer's measured time, says what the extra
    12 micro-batches should cost; the action time is what, added to every
    forward and backward, makes it say what was measured (bisection)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import Schedule1F1B

    from cost_models.pipeline import simulate

    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    inside = rank < 2
    torch.manual_seed(0)
    stage_mod = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(device)
    counts, steps = (4, 16), {}
    for m in counts:
        if inside:
            stage = PipelineStage(stage_mod, rank, 2, device, group=group)
            schedule = Schedule1F1B(stage, m, loss_fn=lambda out, target: out.sum())
            x, y = torch.randn(2 * m, 4, 8, device=device), torch.zeros(2 * m, device=device)
            # as the lowering's train_step calls it (no outputs kept for merging)
            step = ((lambda s=schedule, x=x: s.step(x, return_outputs=False)) if rank == 0
                    else (lambda s=schedule, y=y: s.step(target=y, return_outputs=False)))
        else:
            step = lambda: None  # noqa: E731
        steps[m] = timer(step, inner=4)
    one = torch.randn(2, 4, 8, device=device)

    def transfer():
        if rank == 0:
            dist.send(one, 1, group=group)
            dist.recv(one, 1, group=group)
        elif rank == 1:
            dist.recv(one, 0, group=group)
            dist.send(one, 0, group=group)
    p2p = timer(transfer, inner=20) / 2
    x1 = torch.randn(2, 4, 8, device=device, requires_grad=True)
    fwd = timer(lambda: stage_mod(x1))
    bwd = max(timer(lambda: stage_mod(x1).sum().backward()) - fwd, 0.0)
    measured = (steps[counts[1]] - steps[counts[0]]) / (counts[1] - counts[0])

    def simulated(h: float) -> float:
        t = [simulate("1f1b", 2, m, [fwd + h] * 2, [bwd + h] * 2, [p2p, 0.0]).step_time_s for m in counts]
        return (t[1] - t[0]) / (counts[1] - counts[0])
    if simulated(0.0) >= measured:
        return 0.0
    lo, hi = 0.0, measured
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulated(mid) < measured else (lo, mid)
    return lo


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


def measure_gemm(timer: Timer, device: torch.device, dtype: str, g: dict, overhead: float, progress) -> dict:
    ms, nks = g["gemm_m"], g["gemm_nk"]
    dt = DTYPES[dtype]
    rates = []
    with torch.no_grad():
        for i, m in enumerate(ms):
            for n in nks:
                for k in nks:
                    ops = _rotating(lambda: (torch.randn(m, k, device=device, dtype=dt),
                                             torch.randn(k, n, device=device, dtype=dt)),
                                    (m * k + k * n) * dt.itemsize, device)
                    rates.append(_work_rate(2 * m * n * k, timer, _cycling(torch.mm, ops), overhead))
            progress(f"GEMM {dtype}: m = {m} done ({i + 1}/{len(ms)})")
    return {"m": ms, "n": nks, "k": nks, "flops_per_s": rates}


# Memory-bound ops timed by name (a captured op `mlp:gelu` is priced by the `gelu` table),
# with the class each stands for when an op has no table of its own. Ops with
# transcendental maths (gelu's erf, exp in softmax) are compute-bound on a CPU core,
# so one "elementwise" rate would not do.
OP_TABLES = {"add": "elementwise", "mul": None, "gelu": None, "gelu_tanh": None, "silu": None, "exp": None,
             "native_layer_norm": "norm", "_softmax": "softmax", "_log_softmax": None, "copy": "copy",
             "embedding": "embedding"}


def measure_ops(timer: Timer, device: torch.device, g: dict, overhead: float, progress) -> dict:
    """bytes/s per op (and per op class), by bytes moved per call (reads + writes).
    Rows are a hidden size wide (256), the softmax family a vocabulary or a
    sequence wide (2048): a row's reduction is part of their cost."""
    f = torch.nn.functional
    calls = {
        "add": (lambda x, y, i: x + y, 3, 256), "mul": (lambda x, y, i: x * y, 3, 256),
        "gelu": (lambda x, y, i: f.gelu(x), 2, 256),
        "gelu_tanh": (lambda x, y, i: f.gelu(x, approximate="tanh"), 2, 256),
        "silu": (lambda x, y, i: f.silu(x), 2, 256), "exp": (lambda x, y, i: torch.exp(x), 2, 256),
        "native_layer_norm": (lambda x, y, i: f.layer_norm(x, (x.shape[-1],)), 2, 256),
        "_softmax": (lambda x, y, i: torch.softmax(x, -1), 2, 2048),
        "_log_softmax": (lambda x, y, i: torch.log_softmax(x, -1), 2, 2048),
        "copy": (lambda x, y, i: x.clone(), 2, 256), "embedding": (lambda x, y, i: f.embedding(i, x), 2, 256),
    }
    out = {}
    with torch.no_grad():
        for name, (fn, factor, width) in calls.items():
            sizes, rates = [], []
            for numel in g["elements"]:
                rows = max(1, numel // width)

                def make():
                    x = torch.randn(rows, width, device=device)
                    return x, torch.randn_like(x), torch.randint(0, rows, (rows,), device=device)
                ops = _rotating(make, 3 * rows * width * 4, device)
                nbytes = factor * rows * width * 4
                sizes.append(float(nbytes))
                keep = _copies(rows * width * 4, device)  # the results: one row block each
                rates.append(_work_rate(nbytes, timer, _cycling(fn, ops, keep=keep), overhead))
            out[name] = {"bytes": sizes, "bytes_per_s": rates}
            if OP_TABLES[name]:
                out[OP_TABLES[name]] = out[name]
    for name, (fn, _, width) in calls.items():
        if name in BACKWARD_TABLES:
            out[name + ".bwd"] = _measure_op_backward(timer, device, fn, width, g["elements"])
            if OP_TABLES[name]:
                out[OP_TABLES[name] + ".bwd"] = out[name + ".bwd"]
    progress(f"memory-bound ops: {', '.join(calls)} done (forward; backward of {', '.join(BACKWARD_TABLES)})")
    return out


# Ops whose backward is a kernel of its own with another speed per byte than the forward
# (gelu's backward evaluates the derivative, not the function: on one CPU core tanh-GELU's
# backward moved 3 tensors in the time its forward moved 2). add and copy pass the gradient on.
BACKWARD_TABLES = ("mul", "gelu", "gelu_tanh", "silu", "exp", "native_layer_norm", "_softmax", "_log_softmax",
                   "embedding")


def _bytes_moved(fn) -> int:
    """Bytes fn's aten ops read and write, counted as capture counts an op's bytes
    (every tensor argument and output of an op that moves data; views move none), so
    a table's bytes per call and a captured op's bytes mean the same thing."""
    from torch.utils._pytree import tree_flatten

    from autopar.capture import ops as opinfo

    def weigh(func, args, kwargs, out):
        if opinfo.moves_no_data(func):
            return 0
        return sum(opinfo.tensor_bytes(t) for t in tree_flatten((args, kwargs, out))[0]
                   if isinstance(t, torch.Tensor))
    return _dispatched(fn, weigh)


def _measure_op_backward(timer: Timer, device: torch.device, fn, width: int, elements: list) -> dict:
    """bytes/s of an op's backward, by the bytes its backward kernels move per call. As in
    a step: the saved tensors were written a whole forward ago (rotating, cold), the
    incoming gradient was just written by the op after it in backward (one buffer,
    reused: as warm as the caches keep it), the gradient it makes lands in a buffer
    freed long before (kept results)."""
    sizes, rates = [], []
    # autograd.grad's own fixed cost (the engine starting, once per call: a step pays it
    # once, not per op) is taken out with the one-row call's time; the host time of each
    # backward op is charged per op by the cost model, as for forward ops
    one = torch.randn(1, width, device=device, requires_grad=True)
    one_out = fn(one, torch.randn(1, width, device=device), torch.zeros(1, dtype=torch.long, device=device))
    one_grad = torch.randn_like(one_out)
    fixed = timer(lambda: torch.autograd.grad(one_out, one, one_grad, retain_graph=True))
    for numel in elements:
        rows = max(1, numel // width)

        def make():
            x = torch.randn(rows, width, device=device)
            return x, torch.randn_like(x), torch.randint(0, rows, (rows,), device=device)
        sets = _rotating(make, 3 * rows * width * 4, device)
        graphs = [(fn(x.requires_grad_(), y, i), x) for x, y, i in sets]
        grad = torch.randn_like(graphs[0][0])

        def backward(out, x):
            return torch.autograd.grad(out, x, grad, retain_graph=True)
        nbytes = _bytes_moved(lambda: backward(*graphs[0]))
        keep = _copies(rows * width * 4, device)
        sizes.append(float(nbytes))
        rates.append(_work_rate(nbytes, timer, _cycling(backward, graphs, keep=keep), fixed))
        del graphs, sets
    return {"bytes": sizes, "bytes_per_s": rates}


def measure_optimizer(timer: Timer, device: torch.device, progress, mesh=None) -> dict:
    """Seconds of optimizer.step() for torch's default implementation on this device
    (CPU: a loop over tensors; CUDA: foreach), as a + b x tensors + c x elements,
    each constant from the points it dominates. With a mesh, also over DTensor
    parameters sharded on it (what FSDP2 and tensor parallelism hand the
    optimizer: every per-tensor op goes through DTensor's dispatch)."""
    from torch.distributed.tensor import DTensor, Shard

    world = mesh.size() if mesh is not None else 1
    # the large total (64 MiB per fp32 array on a CPU) is beyond the caches, as a real step's
    # state is: backward has evicted it by the time the optimizer runs
    large = 2**24 if device.type == "cpu" else 2**28

    def param(numel: int, sharded: bool):
        if not sharded:
            return torch.nn.Parameter(torch.randn(numel, device=device))
        local = torch.randn(max(1, numel // world), device=device)
        return torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))

    fits = {}
    for sharded in ((False, True) if mesh is not None else (False,)):
        for name, make in (("adam", lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
                           ("sgd", lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9))):
            secs = {}
            for tensors in (4, 64):
                for total in (2**12, large):
                    params = [param(max(1, total // tensors), sharded) for _ in range(tensors)]
                    for p in params:
                        p.grad = torch.randn_like(p)
                    opt = make(params)
                    secs[tensors, total] = timer(opt.step)
                    del opt, params
            per_tensor = max(0.0, (secs[64, 2**12] - secs[4, 2**12]) / 60)
            per_step = max(0.0, secs[4, 2**12] - 4 * per_tensor)
            local = large / (world if sharded else 1)  # the elements this rank updates
            per_param = statistics.mean(max(1e-15, (secs[t, large] - per_step - t * per_tensor) / local)
                                        for t in (4, 64))
            fits[name + (":dtensor" if sharded else "")] = {"per_step_s": per_step, "per_tensor_s": per_tensor,
                                                             "per_param_s": per_param}
    progress("optimizer steps (AdamW, SGD; plain and DTensor parameters) done")
    return fits


def measure_attention(timer: Timer, device: torch.device, dtypes, g: dict, over: dict, progress) -> list:
    """SDPA per dtype: the kernel torch picks differs by dtype (flash for bf16/fp16 on
    a GPU, memory-efficient or math for fp32), and so does its speed, by 5x or more."""
    f = torch.nn.functional
    h, d = g["attn_heads"], g["attn_dim"]
    rows = []
    for dtype in dtypes:
        for causal in (True, False):
            fwd_rates, bwd_rates, flops = [], [], []
            for s in g["attn_seq"]:
                q, k, v = (torch.randn(1, h, s, d, device=device, dtype=DTYPES[dtype], requires_grad=True)
                           for _ in range(3))
                work = 4.0 * h * s * s * d  # counted unmasked, as the workload counts attention
                with torch.no_grad():
                    fwd_rates.append(_work_rate(work, timer, lambda: f.scaled_dot_product_attention(
                        q, k, v, is_causal=causal), over["no_grad"]))
                out = f.scaled_dot_product_attention(q, k, v, is_causal=causal)
                grad = torch.randn_like(out)
                bwd_rates.append(_work_rate(work, timer, lambda: torch.autograd.grad(
                    out, (q, k, v), grad, retain_graph=True), over["bwd"]))
                flops.append(work)
            # the sequence length of each point: the cost model prices a call of b x h
            # sequences at the rate measured at its length (measured.attention_time)
            seqs = [float(s) for s in g["attn_seq"]]
            rows += [{"dtype": dtype, "causal": causal, "direction": "fwd", "flops": flops,
                      "flops_per_s": fwd_rates, "seq": seqs},
                     {"dtype": dtype, "causal": causal, "direction": "bwd", "flops": flops,
                      "flops_per_s": bwd_rates, "seq": seqs}]
            progress(f"attention {dtype} ({'causal' if causal else 'full'}) done")
    return rows


def measure_gemm_unaligned(timer: Timer, device: torch.device, dtype: str, overhead: float) -> dict:
    """How much slower a GEMM runs when n or k is not a multiple of 16 bytes (GPT-2's
    vocabulary of 50257, say): the tensor-core kernels need aligned rows, and BLAS
    falls back to kernels that are several times slower on a GPU. Timed as pairs,
    aligned and one element short of aligned, at a few sizes; slowdown = mean of
    the n- and k-unaligned times over the aligned time."""
    dt = DTYPES[dtype]
    shapes = ([(2048, 2048, 2048), (8192, 8192, 4096), (8192, 50304, 768)] if device.type == "cuda"
              else [(256, 256, 256), (1024, 1024, 256)])
    flops, slowdown = [], []
    with torch.no_grad():
        for m, n, k in shapes:
            def timed(n_, k_):
                ops = _rotating(lambda: (torch.randn(m, k_, device=device, dtype=dt),
                                         torch.randn(k_, n_, device=device, dtype=dt)),
                                (m * k_ + k_ * n_) * dt.itemsize, device)
                return _work_seconds(timer, _cycling(torch.mm, ops), overhead)  # positive: a call is some work
            aligned = timed(n, k)
            flops.append(2.0 * m * n * k)
            slowdown.append(max(1.0, (timed(n - 1, k) + timed(n, k - 1)) / 2 / aligned))
    return {"flops": flops, "slowdown": slowdown}


# -- collectives ------------------------------------------------------------------------
def _collective(kind: str, nbytes: int, group, n: int, rank: int, device: torch.device):
    import torch.distributed as dist

    numel = max(1, nbytes // 4)
    if kind == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "broadcast":
        t = torch.ones(numel, device=device)
        return lambda: dist.broadcast(t, src=0, group=group)
    if kind == "all_gather":  # nccl-tests convention: nbytes is the gathered output
        out = torch.empty(max(n, numel // n * n), device=device)
        inp = torch.ones(out.numel() // n, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, inp, group=group)
    if kind == "reduce_scatter":  # nbytes is the input
        inp = torch.ones(max(n, numel // n * n), device=device)
        out = torch.empty(inp.numel() // n, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, inp, group=group)
    if kind == "all_to_all":  # nbytes is one rank's send buffer
        inp = torch.ones(max(n, numel // n * n), device=device)
        out = torch.empty_like(inp)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    # p2p: ranks 0 and 1 exchange one buffer each way; half the round trip is one send
    t = torch.ones(numel, device=device)
    peer = 1 - rank

    def ping_pong():
        if rank == 0:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
    return ping_pong


def measure_overlap(timer: Timer, device: torch.device, settings: Settings) -> float:
    """Share of a collective that hides under compute issued while it runs: GEMMs
    alone (t_c), an all-reduce alone (t_a), then the all-reduce issued async and
    the same GEMMs run before waiting on it (t_both). Hidden = t_c + t_a - t_both,
    as a share of the shorter of the two."""
    import torch.distributed as dist

    side, reps, numel = (4096, 8, 2**26) if device.type == "cuda" else (256, 24, 2**20)
    a = torch.randn(side, side, device=device)
    buf = torch.ones(numel, device=device)

    def gemms():
        for _ in range(reps):
            torch.mm(a, a)

    def both():
        work = dist.all_reduce(buf, async_op=True)
        gemms()
        work.wait()

    # A difference of three timings, so sampled in turn (A B C A B C ...) and each the
    # median of 15: timed one after another the share read 10% to 99% on one VM from
    # one calibration to the next (moving DDP's predicted step by 15%); in turn, 0-13%.
    # (A share per round, then its median, is noisier still: the division amplifies.)
    t = interleaved(timer, {"gemms": gemms, "all_reduce": lambda: dist.all_reduce(buf), "both": both},
                    inner=1, repeats=max(15, timer.settings.repeats))
    t_c, t_a, t_both = t["gemms"], t["all_reduce"], t["both"]
    hidden = (t_c + t_a - t_both) / max(min(t_c, t_a), 1e-9)
    return float(min(1.0, max(0.0, hidden)))


def measure_fsdp(timer: Timer, device: torch.device, mesh, param_dtype: str | None = None) -> dict:
    """What FSDP2 costs per unit, its collectives included (hooks, copy-in and
    copy-out of the flat buffers, DTensor gradient bookkeeping, the all-gathers and
    the reduce-scatter): a stack of Linear units, each its own fully_shard unit,
    trained with and without FSDP2, per unit. Once with gradient sync off (two
    all-gathers per unit: forward and backward) and once with it on (plus the
    reduce-scatter), at two unit sizes. The cost model takes the collective
    table's part at this group size out and prices the group it plans instead.
    `param_dtype` ('bf16'): FSDP2's mixed precision, as autopar lowers a bf16 plan
    (on one GPU too: the casts to and from the compute dtype are FSDP2's); the
    plain stack then runs in that dtype, so the difference is FSDP2's alone."""
    import copy

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = {} if param_dtype is None else {
        "mp_policy": MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype], reduce_dtype=torch.float32)}

    world = mesh.size()
    units = 8
    dtype = DTYPES[param_dtype] if param_dtype else torch.float32

    def per_unit(d: int, tensors: int) -> tuple[float, float]:
        """(seconds per all-gather, per reduce-scatter) of units of `tensors` d x d weights."""
        torch.manual_seed(0)
        plain = torch.nn.Sequential(*[torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False)
                                                            for _ in range(tensors)])
                                      for _ in range(units)]).to(device)
        sharded = copy.deepcopy(plain)
        for layer in sharded:
            fully_shard(layer, mesh=mesh, **mp)
        fully_shard(sharded, mesh=mesh, **mp)
        plain = plain.to(dtype)
        # as many rows as the unit has inputs, so each unit computes while its neighbours'
        # collectives are in flight, as in training (on a CPU they then compete for cores)
        x = torch.randn(d, d, device=device, dtype=dtype)

        def step(sync: bool):
            sharded.set_requires_gradient_sync(sync)
            sharded(x).sum().backward()
        t = interleaved(timer, {"plain": lambda: plain(x).sum().backward(), "nosync": lambda: step(False),
                                "sync": lambda: step(True)}, inner=4)
        # whole cost per all-gather / reduce-scatter, the collective included: the cost model
        # takes the collective table's part out again, which cancels exactly at this group size
        return (max((t["nosync"] - t["plain"]) / units / 2, 1e-7), max((t["sync"] - t["nosync"]) / units, 1e-7))

    table = {"ranks": world, "param_dtype": param_dtype or "fp32", "unit_bytes": [], "gather_s": [],
             "reduce_s": []}
    sizes = (16, 512) if device.type == "cpu" else (64, 4096)
    for d in sizes:
        gather, reduce = per_unit(d, 1)
        table["unit_bytes"].append(d * d * 4.0)  # one unit's unsharded fp32 parameters
        table["gather_s"].append(gather)
        table["reduce_s"].append(reduce)
    # FSDP2 works per parameter too (copy-in and copy-out views, gradient DTensors): a
    # unit of 8 small weights against one, per extra tensor
    many = 8
    gather, reduce = per_unit(sizes[0], many)
    table["tensor_gather_s"] = max(0.0, (gather - table["gather_s"][0]) / (many - 1))
    table["tensor_reduce_s"] = max(0.0, (reduce - table["reduce_s"][0]) / (many - 1))
    return table


def _group_sizes(ranks: int) -> list[int]:
    sizes = [2 ** i for i in range(1, int(math.log2(ranks)) + 1)]
    return sizes + ([ranks] if ranks not in sizes and ranks > 1 else [])


def _worker(rank: int, world: int, port: int, settings: Settings, queue) -> None:
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if settings.device == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        else:
            torch.set_num_threads(settings.threads())
            device = torch.device("cpu")
        dist.init_process_group(settings.backend, rank=rank, world_size=world)
        barrier = dist.barrier if settings.device == "cpu" else None
        timer = Timer(settings, device, barrier)
        g = grids(settings)
        say = (lambda text: queue.put(("progress", text))) if rank == 0 else (lambda text: None)
        result: dict = {}
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        over = measure_overhead(timer, device)
        # DTensor's host time, on a one-rank mesh of each rank's own (every rank makes every group)
        one_rank = mesh if world == 1 else DeviceMesh.from_group(dist.new_subgroups(1)[0], device.type)
        over.update(measure_dtensor_overhead(timer, device, one_rank, eager=over))
        if settings.device == "cpu" or rank == 0:  # CPU ranks contend for the machine: all time together
            say(f"host time per op: {over['fwd'] * 1e6:.1f} us forward, {over['bwd'] * 1e6:.1f} us backward")
            result["overhead"] = over
            probe_before = speed_probe(device, barrier=barrier)
            result["gemm"] = {dt: measure_gemm(timer, device, dt, g, over["no_grad"], say) for dt in settings.dtypes}
            result["bandwidth"] = measure_ops(timer, device, g, over["no_grad"], say)
            result["attention"] = measure_attention(timer, device, settings.dtypes, g, over, say)
            result["gemm_unaligned"] = {dt: measure_gemm_unaligned(timer, device, dt, over["no_grad"])
                                        for dt in settings.dtypes}
            result["optimizer"] = measure_optimizer(timer, device, say, mesh)
            # the machine's pace while the compute tables were measured (see speed_probe)
            result["speed_probe_s"] = (probe_before + speed_probe(device, barrier=barrier)) / 2
        say(f"DTensor host time per op: {over['dtensor_fwd'] * 1e6:.1f} us forward, "
            f"{over['dtensor_bwd'] * 1e6:.1f} us backward")
        if over.get("by_activation"):
            table = over["by_activation"]
            say("DTensor time per op by activation: " + ", ".join(
                f"{b / 2**10:.0f} KiB {f * 1e6:.0f}/{w * 1e6:.0f} us"
                for b, f, w in zip(table["bytes"], table["fwd_s"], table["bwd_s"])))
        dist.barrier()
        coll: dict = {}
        ctimer = Timer(settings, device, dist.barrier)
        if world == 1:  # one GPU (or one CPU process): compute only; collectives keep their physics
            # autopar lowers a bf16 plan on one GPU through FSDP2's mixed precision: time that
            fsdp = measure_fsdp(ctimer, device, mesh, "bf16") if "bf16" in settings.dtypes else None
            if fsdp:
                say(f"FSDP2 (one rank, bf16 mixed precision) per small unit: {fsdp['gather_s'][0] * 1e6:.0f} us "
                    f"per all-gather, {fsdp['reduce_s'][0] * 1e6:.0f} us per reduce-scatter")
            if rank == 0:
                queue.put(("result", {**result, "collectives": {}, "funcol": 0.0, "fsdp": fsdp,
                                      "collective_overlap": None}))
            dist.destroy_process_group()
            return
        for n in _group_sizes(world):
            group = dist.new_group(list(range(n)))
            for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p"):
                if kind == "p2p" and n != 2:
                    continue
                sizes, secs = [], []
                for nbytes in g["coll_bytes"]:
                    if rank < n:
                        fn = _collective(kind, nbytes, group, n, rank, device)
                    else:
                        fn = lambda: None  # noqa: E731  (outside the group: keep the barriers company)
                    t = ctimer(fn, inner=max(1, min(20, 2**22 // nbytes)))
                    sizes.append(float(nbytes))
                    secs.append(t / 2 if kind == "p2p" else t)
                coll.setdefault(kind, {})[str(n)] = {"bytes": sizes, "seconds": secs}
            say(f"collectives over {n} ranks done")
        result["collectives"] = coll
        result["funcol"] = measure_tp_collective_overhead(ctimer, device, mesh, one_rank)
        say(f"a tensor-parallel block's collective costs {result['funcol'] * 1e6:.0f} us beyond a plain one")
        result["pipeline_action"] = measure_pipeline_action(ctimer, device)
        say(f"pipeline schedule host time per action: {result['pipeline_action'] * 1e6:.0f} us")
        result["fsdp"] = measure_fsdp(ctimer, device, mesh)
        say(f"FSDP2 per small unit: {result['fsdp']['gather_s'][0] * 1e6:.0f} us per all-gather, "
            f"{result['fsdp']['reduce_s'][0] * 1e6:.0f} us per reduce-scatter, collectives included")
        result["collective_overlap"] = measure_overlap(ctimer, device, settings)
        say(f"collective hidden under compute: {result['collective_overlap']:.0%}")
        if rank == 0:
            queue.put(("result", result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it; a rank never hangs the others silently
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(settings: Settings, progress=None, runs: int = 1) -> Profile:
    """Run every measurement on `settings.ranks` processes and return the profile.
    `runs` > 1: calibrate that many times, every number the median of its runs
    (`cost_models.measured.median_profile`: a shared machine's slow spells)."""
    if runs > 1:
        from cost_models.measured import median_profile

        say = progress or (lambda text: None)
        profiles = []
        for i in range(runs):
            say(f"calibration run {i + 1} of {runs}")
            profiles.append(calibrate(settings, progress))
        return median_profile(profiles)
    return _calibrate_once(settings, progress)


def _calibrate_once(settings: Settings, progress=None) -> Profile:
    import torch.multiprocessing as mp

    progress = progress or (lambda text: None)
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible to torch")
    if settings.device == "cuda" and settings.ranks > torch.cuda.device_count():
        raise RuntimeError(f"--ranks {settings.ranks}: only {torch.cuda.device_count()} GPUs are visible")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, settings.ranks, port, settings, queue), daemon=True)
             for r in range(settings.ranks)]
    for p in procs:
        p.start()
    result, error = None, None
    heard = time.monotonic()
    while result is None and error is None:
        try:
            kind, payload = queue.get(timeout=5)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                error = "a calibration rank exited early (exit codes " + \
                        ", ".join(str(p.exitcode) for p in procs) + ")"
            elif time.monotonic() - heard > SILENCE_LIMIT_S:  # a stuck collective: say so, never hang
                error = f"no rank reported for {SILENCE_LIMIT_S:.0f} s (a collective that never completed?)"
            continue
        heard = time.monotonic()
        if kind == "progress":
            progress(payload)
        elif kind == "error":
            error = payload
        else:
            result = payload
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if error:
        raise RuntimeError(f"calibration failed: {error}")
    return build_profile(result, settings)


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
