"""Pipeline schedules, simulated event by event.

Each pp rank runs a fixed order of (phase, micro-batch, chunk) operations
(GPipe: all forwards then all backwards; 1F1B: pp - rank - 1 warm-up
forwards, then one-forward-one-backward, then the cool-down backwards;
interleaved 1F1B: Megatron's order over V chunks per rank, stage i on rank
i % pp). An operation starts when its rank is free and its input has
arrived: a forward needs the previous stage's forward of the same
micro-batch plus the point-to-point transfer; a backward needs the next
stage's backward (the last stage: its own forward). Simulating instead of
using (p-1)/m catches unequal stages, p2p latency and the warm-up shape
of interleaving, and it yields the peak number of micro-batches whose
activations each rank holds at once.

The orders are torch.distributed.pipelining's, which autopar lowers onto:
for m % pp == 0, ScheduleInterleaved1F1B's action list is exactly Megatron's
order below (tested op for op), and Schedule1F1B's pp - rank warm-up forwards
hold the same peak as the pp - rank - 1 here plus the forward of the first
1F1B step. The peak count equals memory.in_flight_micro_batches; the peak
*bytes* (`peak_activation_bytes`) count each chunk's own size, which matters
when a rank's chunks differ (the first chunk is held longest).

`timeline(...)` exposes the events for the report (docs/INTERFACES.md s.8).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from cost_models.errors import CostModelError


@dataclass
class PipelineResult:
    step_time_s: float  # last backward finished (no DP reduction / optimizer)
    finish_s: list  # per pp rank: when its last backward ended
    busy_s: list  # per pp rank: sum of its compute
    bubble_s: list  # per pp rank: finish - busy
    peak_in_flight: list  # per pp rank: peak micro-batches held (chunks / V)
    peak_activation_bytes: list  # per pp rank, when stage activation bytes are given
    events: list = field(default_factory=list)  # dicts: pp_rank, stage, micro_batch, phase, start_s, end_s


def rank_order(schedule: str, rank: int, pp: int, m: int, v: int = 1) -> list[tuple[str, int, int]]:
    """(phase, micro_batch, chunk) in the order pp rank `rank` runs them."""
    if schedule == "gpipe":
        return [("fwd", i, 0) for i in range(m)] + [("bwd", i, 0) for i in range(m)]
    if schedule == "1f1b":
        v = 1
    total = m * v

    def fwd(k):  # Megatron: pp micro-batches through one chunk, then the next chunk
        return ("fwd", (k // (pp * v)) * pp + k % pp, (k // pp) % v)

    def bwd(k):
        return ("bwd", (k // (pp * v)) * pp + k % pp, v - 1 - (k // pp) % v)

    if v == 1:
        fwd = lambda k: ("fwd", k, 0)  # noqa: E731
        bwd = lambda k: ("bwd", k, 0)  # noqa: E731
        warmup = pp - rank - 1
    else:
        warmup = (pp - rank - 1) * 2 + (v - 1) * pp
    warmup = min(warmup, total)
    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(warmup + k), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


def simulate(schedule: str, pp: int, num_micro_batches: int, fwd_s: list, bwd_s: list, p2p_s: list | None = None,
             *, virtual_stages: int = 1, activation_bytes: list | None = None, keep_events: bool = False,
             blocking_p2p: bool = False) -> PipelineResult:
    """Run the schedule. fwd_s / bwd_s / p2p_s / activation_bytes are per stage
    (len pp * V, stage i on rank i % pp); p2p_s[i] is the send of stage i's
    output to stage i + 1 (and of its input gradient back).

    blocking_p2p=False (torch.distributed.pipelining: isend/irecv on their own
    stream): a transfer only delays its receiver. blocking_p2p=True (Megatron's
    batched send/recv, DeepSpeed's pipeline engine): a large NCCL send is a
    rendezvous, so the transfer starts when both sides reach it and the sender
    cannot start its next op until it has finished; neighbouring stages then
    run in lock-step, which is what makes their bubbles and slots longer.
    """
    if schedule not in ("gpipe", "1f1b", "interleaved"):
        raise CostModelError(f"unknown pipeline schedule '{schedule}' (gpipe, 1f1b, interleaved)")
    v = virtual_stages if schedule == "interleaved" else 1
    n_stages = pp * v
    rendezvous = blocking_p2p and v == 1
    if blocking_p2p and v > 1:
        # Megatron batches the interleaved exchanges so that none waits on a rendezvous;
        # the sender still blocks for its own transfer, which lengthens its op.
        p2p_busy = list(p2p_s) if p2p_s is not None else [0.0] * n_stages
        fwd_s = [f + p2p_busy[i] for i, f in enumerate(fwd_s)]
        bwd_s = [b + (p2p_busy[i - 1] if i > 0 else 0.0) for i, b in enumerate(bwd_s)]
    if len(fwd_s) != n_stages or len(bwd_s) != n_stages:
        raise CostModelError(f"need {n_stages} per-stage times (pp x virtual_stages), got {len(fwd_s)}/{len(bwd_s)}")
    if schedule == "interleaved" and pp > 1 and num_micro_batches % pp:
        raise CostModelError(f"interleaved schedule needs num_micro_batches ({num_micro_batches}) divisible by pp ({pp})")
    p2p = list(p2p_s) if p2p_s is not None else [0.0] * n_stages
    act = list(activation_bytes) if activation_bytes is not None else [1.0] * n_stages
    m = num_micro_batches
    orders = [rank_order(schedule, r, pp, m, v) for r in range(pp)]
    pos = [0] * pp
    clock = [0.0] * pp
    busy = [0.0] * pp
    live_chunks = [0] * pp
    live_bytes = [0.0] * pp
    peak_chunks = [0] * pp
    peak_bytes = [0.0] * pp
    fwd_done: dict = {}
    bwd_done: dict = {}
    index = [{op: i for i, op in enumerate(o)} for o in orders]
    op_end = [[0.0] * len(o) for o in orders]
    pending_send: list = [None] * pp  # blocking mode: (receiver rank, its op index, send end, transfer s)
    events = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            order = orders[r]
            while pos[r] < len(order):
                if pending_send[r] is not None:  # wait until the receiver reaches the matching recv
                    rr, ri, sent, xfer = pending_send[r]
                    if pos[rr] < ri:
                        break
                    clock[r] = max(clock[r], max(sent, op_end[rr][ri - 1] if ri > 0 else 0.0) + xfer)
                    pending_send[r] = None
                phase, mb, chunk = order[pos[r]]
                stage = chunk * pp + r
                if phase == "fwd":
                    if stage == 0:
                        dep, xfer = 0.0, 0.0
                    else:
                        dep = fwd_done.get((stage - 1, mb))
                        if dep is None:
                            break
                        xfer = p2p[stage - 1]
                    dur = fwd_s[stage]
                else:
                    if stage == n_stages - 1:
                        dep, xfer = fwd_done.get((stage, mb)), 0.0
                        if dep is None:
                            break
                    else:
                        dep = bwd_done.get((stage + 1, mb))
                        if dep is None:
                            break
                        xfer = p2p[stage]
                    dur = bwd_s[stage]
                if rendezvous and xfer:
                    start = max(clock[r], dep) + xfer  # rendezvous: both sides wait for the transfer
                else:
                    start = max(clock[r], dep + xfer)
                end = start + dur
                op_end[r][pos[r]] = end
                if rendezvous and pp > 1:
                    to = stage + 1 if phase == "fwd" else stage - 1
                    if 0 <= to < n_stages:
                        rr = to % pp
                        key = (phase, mb, to // pp)
                        pending_send[r] = (rr, index[rr][key], end, p2p[stage] if phase == "fwd" else p2p[to])
                clock[r] = end
                busy[r] += dur
                if phase == "fwd":
                    fwd_done[(stage, mb)] = end
                    live_chunks[r] += 1
                    live_bytes[r] += act[stage]
                    peak_chunks[r] = max(peak_chunks[r], live_chunks[r])
                    peak_bytes[r] = max(peak_bytes[r], live_bytes[r])
                else:
                    bwd_done[(stage, mb)] = end
                    live_chunks[r] -= 1
                    live_bytes[r] -= act[stage]
                if keep_events:
                    events.append({"pp_rank": r, "stage": stage, "micro_batch": mb, "phase": phase,
                                   "start_s": start, "end_s": end})
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # a schedule bug, never user input: fail loudly
            raise CostModelError(f"pipeline schedule '{schedule}' deadlocked (pp={pp}, m={m}, V={v})")
    finish = list(clock)
    return PipelineResult(
        step_time_s=max(finish),
        finish_s=finish,
        busy_s=busy,
        bubble_s=[f - b for f, b in zip(finish, busy)],
        peak_in_flight=[c / v for c in peak_chunks],
        peak_activation_bytes=peak_bytes if activation_bytes is not None else [0.0] * pp,
        events=sorted(events, key=lambda e: (e["pp_rank"], e["start_s"])),
    )


def timeline(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int = 1, *, fwd_s: list, bwd_s: list,
             p2p_s: list | None = None, blocking_p2p: bool = False) -> list[dict]:
    """The simulated schedule's events, for drawing: dicts with pp_rank, stage,
    micro_batch, phase ('fwd'|'bwd'), start_s, end_s (sorted by rank, start)."""
    return simulate(schedule, pp, num_micro_batches, fwd_s, bwd_s, p2p_s,
                    virtual_stages=virtual_stages, keep_events=True, blocking_p2p=blocking_p2p).events


schedule_events = timeline


def closed_form_bubble_fraction(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int = 1) -> float:
    """Textbook bubble / ideal time: (p-1)/m, or (p-1)/(V m) interleaved."""
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * num_micro_batches)


@lru_cache(maxsize=4096)
def _cached(schedule, pp, m, v, fwd, bwd, p2p, act, blocking):
    return simulate(schedule, pp, m, list(fwd), list(bwd), list(p2p), virtual_stages=v, activation_bytes=list(act),
                    blocking_p2p=blocking)


def simulate_cached(schedule: str, pp: int, m: int, fwd_s, bwd_s, p2p_s, *, virtual_stages: int = 1,
                    activation_bytes=None, blocking_p2p: bool = False) -> PipelineResult:
    """`simulate` memoised on its (rounded) inputs, for planners that re-price layouts."""
    r = lambda xs: tuple(round(float(x), 12) for x in xs)  # noqa: E731
    act = activation_bytes if activation_bytes is not None else [0.0] * len(fwd_s)
    return _cached(schedule, pp, m, virtual_stages, r(fwd_s), r(bwd_s), r(p2p_s), r(act), blocking_p2p)
