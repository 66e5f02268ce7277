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


def _rank_orders(schedule: str, pp: int, m: int, v: int) -> tuple:
    """Per rank, (rank_order as a tuple, its ops as (forward?, micro-batch, stage)): kept
    for the schedules of up to 2^16 rank-ops (a planner simulates a few dozen schedules
    hundreds of times), built afresh for longer ones."""
    if pp * m * v > 1 << 16:
        return _build_rank_orders(schedule, pp, m, v)
    return _cached_rank_orders(schedule, pp, m, v)


def _build_rank_orders(schedule: str, pp: int, m: int, v: int) -> tuple:
    orders = [tuple(rank_order(schedule, r, pp, m, v)) for r in range(pp)]
    return tuple((order, tuple((phase == "fwd", mb, chunk * pp + r) for phase, mb, chunk in order))
                 for r, order in enumerate(orders))


_cached_rank_orders = lru_cache(maxsize=16)(_build_rank_orders)


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
    run = _Run(schedule, pp, num_micro_batches, v, fwd_s, bwd_s, p2p, act, blocking_p2p and v == 1, keep_events)
    run.until_done()
    finish = list(run.clock)
    return PipelineResult(
        step_time_s=max(finish),
        finish_s=finish,
        busy_s=run.busy,
        bubble_s=[f - b for f, b in zip(finish, run.busy)],
        peak_in_flight=[c / v for c in run.peak_chunks],
        peak_activation_bytes=run.peak_bytes if activation_bytes is not None else [0.0] * pp,
        events=sorted(run.events, key=lambda e: (e["pp_rank"], e["start_s"])),
    )


class _Run:
    """The simulation's state: each rank's position in its order and its clock, when each
    (stage, micro-batch) finished its forward and backward, the activations held."""

    def __init__(self, schedule: str, pp: int, m: int, v: int, fwd_s: list, bwd_s: list, p2p: list, act: list,
                 rendezvous: bool, keep_events: bool):
        self.schedule, self.pp, self.m, self.v = schedule, pp, m, v
        self.n_stages = pp * v
        self.fwd_s, self.bwd_s, self.p2p, self.act = fwd_s, bwd_s, p2p, act
        self.rendezvous, self.keep_events = rendezvous, keep_events
        orders = _rank_orders(schedule, pp, m, v)
        self.orders = [order for order, _ in orders]  # tuples, shared through the cache: read only
        self.ops = [ops for _, ops in orders]  # per op: (forward?, micro-batch, stage), for _until_done_async
        self.pos = [0] * pp
        self.clock = [0.0] * pp
        self.busy = [0.0] * pp
        self.live_chunks = [0] * pp
        self.live_bytes = [0.0] * pp
        self.peak_chunks = [0] * pp
        self.peak_bytes = [0.0] * pp
        self.fwd_done: dict = {}
        self.bwd_done: dict = {}
        if rendezvous or keep_events:  # only the op-by-op path (_advance, _ran) reads them
            self.index = [{op: i for i, op in enumerate(o)} for o in self.orders]
            self.op_end = [[0.0] * len(o) for o in self.orders]
        self.pending_send: list = [None] * pp  # blocking mode: (receiver rank, its op index, send end, transfer s)
        self.events: list = []
        self.remaining = sum(len(o) for o in self.orders)

    def until_done(self) -> None:
        if not self.rendezvous and not self.keep_events:
            self._until_done_async()
            return
        while self.remaining:
            progressed = False
            for r in range(self.pp):
                progressed = self._advance(r) or progressed
            if not progressed:  # a schedule bug, never user input: fail loudly
                raise CostModelError(f"pipeline schedule '{self.schedule}' deadlocked "
                                     f"(pp={self.pp}, m={self.m}, V={self.v})")

    def _until_done_async(self) -> None:
        """until_done for asynchronous sends without events: the same rounds, starts and
        sums (so the same floats), on lists instead of (stage, micro-batch) dicts and
        without a call per op; the planner simulates ~10^6 ops per plan (uniform layouts)."""
        pp, n_stages, m = self.pp, self.n_stages, self.m
        fwd_s, bwd_s, p2p, act = self.fwd_s, self.bwd_s, self.p2p, self.act
        fwd_end = [[None] * m for _ in range(n_stages)]
        bwd_end = [[None] * m for _ in range(n_stages)]
        last = n_stages - 1
        pos, clock, busy = self.pos, self.clock, self.busy
        live, live_b, peak, peak_b = self.live_chunks, self.live_bytes, self.peak_chunks, self.peak_bytes
        while self.remaining:
            progressed = False
            for r in range(pp):
                order, i, c = self.ops[r], pos[r], clock[r]
                n = len(order)
                while i < n:
                    forward, mb, stage = order[i]
                    if forward:
                        if stage == 0:
                            dep, xfer = 0.0, 0.0
                        else:
                            dep, xfer = fwd_end[stage - 1][mb], p2p[stage - 1]
                        dur = fwd_s[stage]
                    elif stage == last:
                        dep, xfer, dur = fwd_end[stage][mb], 0.0, bwd_s[stage]
                    else:
                        dep, xfer, dur = bwd_end[stage + 1][mb], p2p[stage], bwd_s[stage]
                    if dep is None:
                        break
                    c = max(c, dep + xfer) + dur
                    busy[r] += dur
                    if forward:
                        fwd_end[stage][mb] = c
                        live[r] += 1
                        live_b[r] += act[stage]
                        peak[r] = max(peak[r], live[r])
                        peak_b[r] = max(peak_b[r], live_b[r])
                    else:
                        bwd_end[stage][mb] = c
                        live[r] -= 1
                        live_b[r] -= act[stage]
                    i += 1
                if i > pos[r]:
                    progressed = True
                    self.remaining -= i - pos[r]
                    pos[r], clock[r] = i, c
            if not progressed:  # a schedule bug, never user input: fail loudly
                raise CostModelError(f"pipeline schedule '{self.schedule}' deadlocked "
                                     f"(pp={self.pp}, m={self.m}, V={self.v})")

    def _send_done(self, r: int) -> bool:
        """Blocking mode: whether rank r's last send has met its receive (then its clock moves past it)."""
        if self.pending_send[r] is None:
            return True
        rr, ri, sent, xfer = self.pending_send[r]
        if self.pos[rr] < ri:  # wait until the receiver reaches the matching recv
            return False
        self.clock[r] = max(self.clock[r], max(sent, self.op_end[rr][ri - 1] if ri > 0 else 0.0) + xfer)
        self.pending_send[r] = None
        return True

    def _inputs(self, phase: str, mb: int, stage: int):
        """(input ready at, transfer s, duration s) of the op, or None while its input is not done:
        a forward needs the previous stage's forward, a backward the next stage's backward
        (the last stage: its own forward)."""
        if phase == "fwd":
            if stage == 0:
                return 0.0, 0.0, self.fwd_s[stage]
            dep = self.fwd_done.get((stage - 1, mb))
            return None if dep is None else (dep, self.p2p[stage - 1], self.fwd_s[stage])
        if stage == self.n_stages - 1:
            dep = self.fwd_done.get((stage, mb))
            return None if dep is None else (dep, 0.0, self.bwd_s[stage])
        dep = self.bwd_done.get((stage + 1, mb))
        return None if dep is None else (dep, self.p2p[stage], self.bwd_s[stage])

    def _advance(self, r: int) -> bool:
        """Run rank r's next ops while their inputs are there; whether one ran."""
        order, pp, progressed = self.orders[r], self.pp, False
        while self.pos[r] < len(order) and self._send_done(r):
            phase, mb, chunk = order[self.pos[r]]
            stage = chunk * pp + r
            ready = self._inputs(phase, mb, stage)
            if ready is None:
                break
            dep, xfer, dur = ready
            if self.rendezvous and xfer:
                start = max(self.clock[r], dep) + xfer  # rendezvous: both sides wait for the transfer
            else:
                start = max(self.clock[r], dep + xfer)
            self._ran(r, phase, mb, stage, start, start + dur, dur)
            progressed = True
        return progressed

    def _ran(self, r: int, phase: str, mb: int, stage: int, start: float, end: float, dur: float) -> None:
        self.op_end[r][self.pos[r]] = end
        if self.rendezvous and self.pp > 1:
            to = stage + 1 if phase == "fwd" else stage - 1
            if 0 <= to < self.n_stages:
                rr = to % self.pp
                key = (phase, mb, to // self.pp)
                xfer = self.p2p[stage] if phase == "fwd" else self.p2p[to]
                self.pending_send[r] = (rr, self.index[rr][key], end, xfer)
        self.clock[r] = end
        self.busy[r] += dur
        if phase == "fwd":
            self.fwd_done[(stage, mb)] = end
            self.live_chunks[r] += 1
            self.live_bytes[r] += self.act[stage]
            self.peak_chunks[r] = max(self.peak_chunks[r], self.live_chunks[r])
            self.peak_bytes[r] = max(self.peak_bytes[r], self.live_bytes[r])
        else:
            self.bwd_done[(stage, mb)] = end
            self.live_chunks[r] -= 1
            self.live_bytes[r] -= self.act[stage]
        if self.keep_events:
            self.events.append({"pp_rank": r, "stage": stage, "micro_batch": mb, "phase": phase,
                                "start_s": start, "end_s": end})
        self.pos[r] += 1
        self.remaining -= 1


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
