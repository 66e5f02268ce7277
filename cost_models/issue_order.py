"""The last backward in issue order: what its gradient reduction leaves exposed.

cost_models/overlap.py hides each layer's collectives under that layer's own
windows, one layer at a time. This checks the same backward as it runs: the
layers' backward in reverse order on the compute stream; their collectives in
issue order on one link (the reduce-scatter and all-gather streams of FSDP2,
or DDP's buckets, share the GPU's NVLink or NIC):

- a layer's gradient reduction is issued when its backward ends (DDP issues a
  bucket when its last gradient is ready; FSDP2's post-backward hook issues
  the unit's reduce-scatter) and starts when the link is free;
- under FSDP2 the next unit's all-gather is issued as this unit's backward
  starts (backward prefetch of one unit, FSDP2's default) and that unit's
  backward waits for it;
- the step's reductions end when the link drains: whatever runs past the
  last layer's backward is exposed, however the per-layer windows said it hid.

A reduction longer than the backward it hides behind is exposed here whatever
the per-layer shares say. estimate() keeps the larger of this and the sum of
the layers' own exposures, so this can only add.
"""
from __future__ import annotations


def last_backward_exposed(windows: list, gathers: list, reduces: list) -> float:
    """Seconds the last backward's collectives add to it, the layers given in backward order:
    `windows` their backward compute, `gathers` the all-gather each needs first (FSDP2, 0 when
    its parameters are held), `reduces` the gradient reduction each issues when it ends."""
    t = 0.0  # compute stream
    link = gathers[0] if gathers else 0.0  # the first unit's gather: nothing to prefetch it under
    ready = link
    for k, window in enumerate(windows):
        t = max(t, ready)  # the unit's parameters must be gathered
        if k + 1 < len(windows) and gathers[k + 1]:
            link = max(link, t) + gathers[k + 1]  # prefetch of the next unit, issued as this one starts
            ready = link
        t += window
        if reduces[k]:
            link = max(link, t) + reduces[k]
    return max(t, link) - sum(windows)
