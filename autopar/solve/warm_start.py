"""A quick feasible assignment to hand CP-SAT as a hint (warm start).

CP-SAT with one worker and a short deterministic limit spends much of its
first pass finding *any* layout that fits; on deep, memory-bound pipelines
(Llama-3 70B, pp 8, interleaved) its first incumbent was 3.5x the optimum at
0.2 work units. This builds one the way an engineer would by hand:

1. stages balanced by time with every layer at its fastest option;
2. then, on every pp rank over its memory, repeatedly take the option change
   that frees the most memory per nanosecond it adds (checkpoint a block,
   raise its ZeRO level), until the rank fits;
3. then give time back: the option change that saves the most time for as
   many layers as still fit, until none does.

It is a heuristic: it may fail (returns None) or be far from optimal; the
solver only uses it as a starting point, so correctness never depends on it.
"""
from __future__ import annotations

from autopar.solve.problem import StageProblem, evaluate


def balanced_stages(problem: StageProblem) -> list[int]:
    """Stage of each layer: stage s ends where the running total of the layers'
    fastest times comes closest to (s + 1) / S of the whole, so every stage (and
    so every rank) carries about the same time. (`balance_stages` minimises the
    heaviest stage only, which can leave the last stage holding just the head
    and the last rank idle.)"""
    p = problem
    n, stages = p.num_layers, p.num_stages
    weights = [min(o.time for o in p.group_options[g]) + 1 for g in p.layer_group]  # +1: no zero weights
    total = sum(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    bounds = [0]
    for s in range(1, stages):
        target = total * s / stages
        lo, hi = bounds[-1] + 1, n - (stages - s)  # every stage keeps at least one layer
        best = min(range(lo, hi + 1), key=lambda i: (abs(prefix[i] - target), i))
        bounds.append(best)
    bounds.append(n)
    return [s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])]


class RankMemory:
    """A pp rank's peak memory (problem.rank_memory's rule for one rank), kept
    up to date move by move, so trying an option change costs O(V + peak terms)
    instead of a pass over the rank's layers (the 405B warm start made
    230,000 such passes)."""

    def __init__(self, p: StageProblem, r: int, layers: list, stage_of: list, option_of: list):
        self.p, self.vecs = p, p.chunk_counts[r]
        self.static = 0
        self.step = 0  # the optimizer step's temporaries
        self.chunk = [0] * p.virtual_stages
        self.peaks: list = []  # per peak term: value -> number of layers at it
        self._dots = None  # per count vector, its activation bytes (until a chunk changes)
        self._top = self._peak_sum = None  # the peak terms' tallies read (`_tops`)
        self._switched: dict = {}  # (old peaks, new peaks, count) -> _peaks_after, until a layer changes
        for i in layers:
            self._apply(p.group_options[p.layer_group[i]][option_of[i]], stage_of[i] // p.pp, +1)

    def _apply(self, o, chunk: int, n: int) -> None:
        """Add n layers of option `o` in `chunk` (n < 0 removes)."""
        self.static += n * o.static_mem
        self.step += n * o.step_mem
        if o.act_mem:
            self.chunk[chunk] += n * o.act_mem
            self._dots = None
        self._apply_peaks(o, n)

    def switch(self, old, new, chunk: int) -> None:
        """One layer of `chunk` moves from option `old` to `new` (the warm start's moves,
        refine.tidy's kept trials)."""
        self._apply(old, chunk, -1)
        self._apply(new, chunk, +1)

    def _apply_peaks(self, o, n: int) -> None:
        self._top = None
        self._switched = {}
        while len(self.peaks) < len(o.peaks):
            self.peaks.append({})
        for t, value in enumerate(o.peaks):
            counts = self.peaks[t]
            counts[value] = counts.get(value, 0) + n
            if not counts[value]:
                del counts[value]

    def _act_dots(self) -> list:
        if self._dots is None:
            self._dots = [sum(c * a for c, a in zip(vec, self.chunk)) for vec in self.vecs]
        return self._dots

    def _tops(self) -> list:
        """Per peak term: (largest value, layers at it, next value), until a layer changes."""
        if self._top is None:
            self._top = []
            for counts in self.peaks:
                top = max(counts, default=0)
                self._top.append((top, counts.get(top, 0), max((v for v in counts if v != top), default=0)))
            self._peak_sum = sum(top for top, _, _ in self._top)
        return self._top

    def _peaks(self) -> int:
        self._tops()
        return self._peak_sum

    def _peaks_after(self, old, new, count: int) -> int | None:
        """The peak terms' sum if `count` layers at option `old` switched to `new`, read off
        the tallies: a term's largest value changes only when the new value exceeds it or
        when every layer at it leaves. None when fewer than `count` layers hold `old`'s
        value (not a switch of existing layers: `after` then applies and undoes it)."""
        if count <= 0:
            return None
        tops, total = self._tops(), 0
        for t in range(max(len(tops), len(old.peaks), len(new.peaks))):
            top, at_top, second = tops[t] if t < len(tops) else (0, 0, 0)
            if t < len(old.peaks):
                value = old.peaks[t]
                held = at_top if value == top else self.peaks[t].get(value, 0) if t < len(self.peaks) else 0
                if held < count:
                    return None
                if value == top and held == count:  # its last layers leave the top
                    top = second
            if t < len(new.peaks) and new.peaks[t] > top:
                top = new.peaks[t]
            total += top
        return total

    def _total(self, static: int, step: int, act: int, peaks: int | None = None) -> int:
        peaks = self._peaks() if peaks is None else peaks
        return max(static + peaks + act, static + step)

    def total(self) -> int:
        return self._total(self.static, self.step, max(self._act_dots()))

    def after(self, old, new, chunk: int, count: int = 1) -> int:
        """Total if `count` layers of `chunk` switched from option `old` to `new`. The
        activation part moves one chunk by a known amount, so each count vector's sum is
        its cached one plus that, and the peak terms are read off their tallies (the
        warm starts of a deep interleaved mesh ask this ~150,000 times)."""
        delta = count * (new.act_mem - old.act_mem)
        dots = self._act_dots()
        act = max(d + v[chunk] * delta for d, v in zip(dots, self.vecs)) if delta else max(dots)
        static = self.static + count * (new.static_mem - old.static_mem)
        step = self.step + count * (new.step_mem - old.step_mem)
        if old.peaks == new.peaks:
            return self._total(static, step, act)
        key = (old.peaks, new.peaks, count)  # the same in every chunk: asked once per class and chunk
        if key not in self._switched:
            self._switched[key] = self._peaks_after(old, new, count)
        peaks = self._switched[key]
        if peaks is not None:
            return self._total(static, step, act, peaks)
        self._apply_peaks(old, -count)
        self._apply_peaks(new, count)
        value = self._total(static, step, act)
        self._apply_peaks(new, -count)
        self._apply_peaks(old, count)
        return value



def warm_start(problem: StageProblem, max_moves: int | None = None) -> tuple[list, list] | None:
    """(stage_of_layer, option_of_layer) that fits in memory, or None. Cached on
    the problem (the search asks again for candidates it re-solves)."""
    key = (tuple(problem.capacity), max_moves)
    cached = getattr(problem, "_warm_start", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    start = _warm_start(problem, max_moves)
    problem._warm_start = (key, start)
    return start


def _warm_start(problem: StageProblem, max_moves: int | None) -> tuple[list, list] | None:
    p = problem
    if p.num_layers < p.num_stages:
        return None
    stage_of = balanced_stages(p)
    # fastest option per group; ties go to the smaller footprint
    option_of = [min(range(len(p.group_options[g])),
                     key=lambda k, g=g: (p.group_options[g][k].time, p.group_options[g][k].static_mem
                                         + p.group_options[g][k].act_mem)) for g in p.layer_group]
    budget = max_moves if max_moves is not None else 4 * p.num_layers
    for r in range(p.pp):
        layers = [i for i in range(p.num_layers) if stage_of[i] % p.pp == r]
        mem = RankMemory(p, r, layers, stage_of, option_of)
        memory = mem.total()
        while memory > p.capacity[r]:
            if budget <= 0:
                return None
            budget -= 1
            best = None
            for (g, chunk, before), members in _classes(p, layers, stage_of, option_of).items():
                opts = p.group_options[g]
                cur = opts[before]
                for k, o in enumerate(opts):
                    if k == before:
                        continue
                    # one layer, or the whole class at once: a move whose once-per-rank
                    # buffer (FSDP's unsharded layer for ZeRO-3) outweighs one layer's
                    # saving still pays when every such layer makes it
                    freed_all = memory - mem.after(cur, o, chunk, len(members))
                    # ... and just enough of the class to fit, when each layer frees the same
                    enough = -(-(memory - p.capacity[r]) * len(members) // freed_all) if freed_all > 0 else 1
                    for size in sorted({1, min(len(members), max(1, enough)), len(members)}):
                        freed = freed_all if size == len(members) else memory - mem.after(cur, o, chunk, size)
                        if freed <= 0:
                            continue
                        # most memory per nanosecond added; ties: the larger move (fewer rounds),
                        # then the earlier layer and the lower option (deterministic)
                        score = (freed / max(1, size * (o.time - cur.time)), size, -members[0], -k)
                        if best is None or score > best[0]:
                            best = (score, members[:size], k)
            if best is None:
                return None
            _, moved, k = best
            _move(p, moved, k, stage_of, option_of, mem)
            memory = mem.total()
        # moves take whole classes of identical layers, so a few rounds suffice
        _improve(p, r, layers, stage_of, option_of, mem, budget=min(2 * len(layers), 12))
    if evaluate(p, stage_of, option_of) is None:
        return None
    return stage_of, option_of


def _classes(p: StageProblem, layers: list, stage_of: list, option_of: list) -> dict:
    """Layers of one group, chunk and option are interchangeable: one class each,
    keyed (group, chunk, option), members in layer order."""
    classes: dict = {}
    for i in layers:
        classes.setdefault((p.layer_group[i], stage_of[i] // p.pp, option_of[i]), []).append(i)
    return classes


def _move(p: StageProblem, moved: list, k: int, stage_of: list, option_of: list, mem: RankMemory) -> None:
    """Switch the `moved` layers to option k, keeping the rank's memory tally in step."""
    for i in moved:
        opts = p.group_options[p.layer_group[i]]
        mem.switch(opts[option_of[i]], opts[k], stage_of[i] // p.pp)
        option_of[i] = k


def _improve(p: StageProblem, r: int, layers: list, stage_of: list, option_of: list, mem: RankMemory,
             budget: int) -> None:
    """Give time back where memory allows: repeatedly take the option change (for
    as many layers of a class as still fit) that saves the most weighted time.
    The greedy fill above overshoots (it cannot see that ZeRO-3 on every block
    beats full checkpointing on every block); this undoes the excess."""
    def cost(o):
        return p.rank_weight * o.time + p.step_weight * o.step

    for _ in range(budget):
        best = None
        for (g, chunk, before), members in _classes(p, layers, stage_of, option_of).items():
            opts = p.group_options[g]
            cur = opts[before]
            for k, o in enumerate(opts):
                if k == before or cost(o) >= cost(cur):
                    continue
                lo, hi = 0, len(members)  # largest count that still fits (memory grows with it)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if mem.after(cur, o, chunk, mid) <= p.capacity[r]:
                        lo = mid
                    else:
                        hi = mid - 1
                if lo == 0:
                    continue
                score = (lo * (cost(cur) - cost(o)), -members[0], -k)
                if best is None or score > best[0]:
                    best = (score, members[:lo], k)
        if best is None:
            return
        _, moved, k = best
        _move(p, moved, k, stage_of, option_of, mem)
