"""Host time per op: one eager op and one autograd node (a chain of tiny ops),
DTensor's extra host time per op under tensor parallelism (toy Llama blocks
split by autopar's own TP lowering), its collectives beyond plain ones, and
what torch.distributed.pipelining adds per schedule action."""
from __future__ import annotations

import torch

from autopar.calibrate.timing import Timer, interleaved


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

