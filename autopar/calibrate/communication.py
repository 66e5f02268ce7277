"""The communication tables: collectives by size over every power-of-two
group, how much of a collective hides behind compute, and FSDP2's own
all-gather / reduce-scatter."""
from __future__ import annotations

import math

import torch

from autopar.calibrate.timing import Settings, Timer, interleaved
from autopar.precision import DTYPES


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
    # quick (a first look, the tests) stops at a 256-wide unit: 8x fewer FLOPs than 512
    # per step of the stack, which was most of a quick calibration's minute on a CPU
    sizes = ((16, 256) if timer.settings.quick else (16, 512)) if device.type == "cpu" else (64, 4096)
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

