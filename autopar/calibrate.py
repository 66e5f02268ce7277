"""`autopar calibrate`: time this machine and write a measured profile.

What is timed, each on the device and backend training will use:
- the host time of one eager op forward and one autograd node backward
  (a chain of tiny ops; what a small op costs whatever its size);
- GEMMs on a grid of (m, n, k) per dtype;
- memory-bound op classes (elementwise add, copy, layer norm, softmax,
  embedding gather) from cache-sized to memory-sized tensors;
- scaled_dot_product_attention forward and backward, causal and full;
- collectives (all-reduce, all-gather, reduce-scatter, broadcast, all-to-all,
  point-to-point) by size over every power-of-two group up to `ranks`.

Each table entry is one whole call timed with autograd off, dispatch
included; the cost model adds what training adds to it (the host time of
autograd's recording forward, of one autograd node backward). A profile
therefore reproduces each measured point, and the cost model's job is what
lies between the points (cost_models/measured.py).

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

from cost_models.measured import SCHEMA, MeasuredCollectives, MeasuredCompute, Profile

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Settings:
    device: str = "cpu"  # 'cpu' or 'cuda'
    ranks: int = 2  # ranks sharing one node while training (CPU) / GPUs to time collectives over
    threads_per_rank: int | None = None  # CPU: default cores // ranks
    dtypes: tuple = ("fp32", "bf16")
    quick: bool = False  # a small grid (tests, a first look): minutes become seconds
    min_sample_s: float = 0.01  # one timing sample lasts at least this long
    repeats: int = 3  # samples per point; the median is kept

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
             "attn_heads": 4, "attn_dim": 64, "coll_bytes": [2**10, 2**13, 2**16, 2**19, 2**22, 2**25]}
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
        samples = []
        for _ in range(self.settings.repeats):
            if self.barrier is not None:  # every rank times the same work at the same moment
                self.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            self.sync()
            samples.append((time.perf_counter() - t0) / inner)
        return statistics.median(samples)


def _rate(work: float, seconds: float, overhead: float = 0.0) -> float:
    # Raw: a table entry is the whole call (dispatch included) with autograd off; the
    # cost model adds only what training adds to it (autograd's recording, its nodes).
    return work / seconds


def measure_overhead(timer: Timer, device: torch.device) -> dict:
    """Host seconds of one tiny op: forward with autograd recording, its backward
    node, and forward without autograd (what kernel timings include)."""
    n = 64
    x = torch.ones(1, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(n):
            y = y * 1.0001
        return y

    fwd = timer(chain)
    fwd_bwd = timer(lambda: chain().backward())
    with torch.no_grad():
        plain = timer(chain)
    return {"fwd": fwd / n, "bwd": max(fwd_bwd - fwd, 0.0) / n, "no_grad": plain / n}


def measure_gemm(timer: Timer, device: torch.device, dtype: str, g: dict, overhead: float, progress) -> dict:
    ms, nks = g["gemm_m"], g["gemm_nk"]
    rates = []
    with torch.no_grad():
        for i, m in enumerate(ms):
            for n in nks:
                for k in nks:
                    a = torch.randn(m, k, device=device, dtype=DTYPES[dtype])
                    b = torch.randn(k, n, device=device, dtype=DTYPES[dtype])
                    rates.append(_rate(2 * m * n * k, timer(lambda: torch.mm(a, b)), overhead))
            progress(f"GEMM {dtype}: m = {m} done ({i + 1}/{len(ms)})")
    return {"m": ms, "n": nks, "k": nks, "flops_per_s": rates}


def measure_bandwidth(timer: Timer, device: torch.device, g: dict, overhead: float, progress) -> dict:
    """bytes/s per op class, by bytes moved per call (reads + writes)."""
    f = torch.nn.functional
    out = {}
    with torch.no_grad():
        for cls in ("elementwise", "copy", "norm", "softmax", "embedding"):
            sizes, rates = [], []
            for numel in g["elements"]:
                x = torch.randn(numel // 256, 256, device=device)
                if cls == "elementwise":
                    y = torch.randn_like(x)
                    fn, nbytes = (lambda: x + y), 3 * x.nbytes
                elif cls == "copy":
                    fn, nbytes = x.clone, 2 * x.nbytes
                elif cls == "norm":
                    fn, nbytes = (lambda: f.layer_norm(x, (256,))), 2 * x.nbytes
                elif cls == "softmax":
                    fn, nbytes = (lambda: torch.softmax(x, -1)), 2 * x.nbytes
                else:
                    idx = torch.randint(0, x.shape[0], (x.shape[0],), device=device)
                    fn, nbytes = (lambda: f.embedding(idx, x)), 2 * x.nbytes
                sizes.append(float(nbytes))
                rates.append(_rate(nbytes, timer(fn), overhead))
            out[cls] = {"bytes": sizes, "bytes_per_s": rates}
            progress(f"bandwidth: {cls} done")
    return out


def measure_attention(timer: Timer, device: torch.device, dtype: str, g: dict, over: dict, progress) -> list:
    f = torch.nn.functional
    h, d = g["attn_heads"], g["attn_dim"]
    rows = []
    for causal in (True, False):
        fwd_rates, bwd_rates, flops = [], [], []
        for s in g["attn_seq"]:
            q, k, v = (torch.randn(1, h, s, d, device=device, dtype=DTYPES[dtype], requires_grad=True)
                       for _ in range(3))
            work = 4.0 * h * s * s * d  # counted unmasked, as the workload counts attention
            with torch.no_grad():
                t_fwd = timer(lambda: f.scaled_dot_product_attention(q, k, v, is_causal=causal))
            out = f.scaled_dot_product_attention(q, k, v, is_causal=causal)
            grad = torch.randn_like(out)
            t_bwd = timer(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True))
            flops.append(work)
            fwd_rates.append(_rate(work, t_fwd, over["no_grad"]))
            bwd_rates.append(_rate(work, t_bwd, over["bwd"]))
        rows += [{"causal": causal, "direction": "fwd", "flops": flops, "flops_per_s": fwd_rates},
                 {"causal": causal, "direction": "bwd", "flops": flops, "flops_per_s": bwd_rates}]
        progress(f"attention ({'causal' if causal else 'full'}) done")
    return rows


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

    t_c = timer(gemms, inner=1)
    t_a = timer(lambda: dist.all_reduce(buf), inner=1)
    t_both = timer(both, inner=1)
    hidden = (t_c + t_a - t_both) / max(min(t_c, t_a), 1e-9)
    return float(min(1.0, max(0.0, hidden)))


def _group_sizes(ranks: int) -> list[int]:
    sizes = [2 ** i for i in range(1, int(math.log2(ranks)) + 1)]
    return sizes + ([ranks] if ranks not in sizes else [])


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
        if settings.device == "cpu" or rank == 0:  # CPU ranks contend for the machine: all time together
            over = measure_overhead(timer, device)
            say(f"host time per op: {over['fwd'] * 1e6:.1f} us forward, {over['bwd'] * 1e6:.1f} us backward")
            result["overhead"] = over
            result["gemm"] = {dt: measure_gemm(timer, device, dt, g, over["no_grad"], say) for dt in settings.dtypes}
            result["bandwidth"] = measure_bandwidth(timer, device, g, over["no_grad"], say)
            result["attention"] = measure_attention(timer, device, settings.dtypes[0], g, over, say)
        dist.barrier()
        coll: dict = {}
        ctimer = Timer(settings, device, dist.barrier)
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


def calibrate(settings: Settings, progress=None) -> Profile:
    """Run every measurement on `settings.ranks` processes and return the profile."""
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
    while result is None and error is None:
        try:
            kind, payload = queue.get(timeout=5)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                error = "a calibration rank exited early (exit codes " + \
                        ", ".join(str(p.exitcode) for p in procs) + ")"
            continue
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
    peaks = {dt: max(t["flops_per_s"]) / 1e12 for dt, t in gemm.items()}
    if "bf16" in peaks:
        peaks.setdefault("fp16", peaks["bf16"])
    bandwidth = max(max(t["bytes_per_s"]) for t in result["bandwidth"].values())
    attention_peak = max(max(a["flops_per_s"]) for a in result["attention"] if a["direction"] == "fwd")
    attention_bwd = max(max(a["flops_per_s"]) for a in result["attention"] if a["direction"] == "bwd")
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
        "collective_overlap": result["collective_overlap"],
        "source": f"autopar calibrate on {socket.gethostname()} ({name})",
    }
    compute = {"gemm": gemm, "bandwidth": result["bandwidth"], "attention": result["attention"],
               "op_overhead_fwd_s": result["overhead"]["fwd"], "op_overhead_bwd_s": result["overhead"]["bwd"],
               "op_overhead_no_grad_s": result["overhead"]["no_grad"]}
    machine = {"host": socket.gethostname(), "processor": name, "torch": torch.__version__,
               "python": sys.version.split()[0], "backend": settings.backend, "ranks": settings.ranks,
               "threads_per_rank": settings.threads() if settings.device == "cpu" else None,
               "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "settings": asdict(settings)}
    data = {"schema": SCHEMA, "machine": machine, "device_name": device_name, "device": device,
            "compute": compute, "collectives": {"intra_node": result["collectives"]}}
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
