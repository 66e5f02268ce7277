"""Fused kernels in the plan: find them, and let the cost model charge them.

`plan_fusions` runs the fusion pass (`autopar.kernels.fusion.find_fusions`)
over the model the planner captured; the records go into `Plan.fusions`, and
`autopar.compile(..., fusion=True)` swaps them in. `charge_fusions` gives the
cost model a copy of the ModelSpec whose layers carry the HBM bytes those
chains save (`LayerSpec.fused_bytes_saved_fwd/bwd`), so the layout search and
the Plan's predicted numbers price the fused module that will actually run.
"""
from __future__ import annotations

import copy
import hashlib
from collections import Counter

from cost_models.workload import B, S

from autopar.errors import AutoparError

# Chains whose saving is not in any captured layer's ops: the loss (and so the
# chunked cross-entropy) runs outside the model the capture traced.
_NOT_IN_LAYERS = ("linear_cross_entropy",)


def plan_fusions(module, spec) -> tuple[list[dict], str | None]:
    """(fusion records, why none) for `module` (an nn.Module, or None when the
    planner was given a bare ModelSpec, which has no modules to trace)."""
    if module is None:
        return [], "no nn.Module to trace (planned from a ModelSpec)"
    from autopar.kernels.fusion import find_fusions

    try:
        return find_fusions(module, spec), None
    except AutoparError as exc:  # a model the pass cannot read plans unfused, and says why
        return [], f"fusion pass failed: {exc.message}"


def charge_fusions(spec, fusions: list[dict], device):
    """`spec` with each layer's fused byte savings set (copies; the input is not
    touched). Unchanged on a `cpu` device profile: there the torch fallback runs
    the same eager ops, so nothing is saved."""
    if not fusions or getattr(device, "vendor", "nvidia") == "cpu":
        return spec
    from autopar.kernels.fusion import fusion_savings_by_layer

    seq = S if spec.seq_len else None
    tokens = B * S if spec.seq_len else B  # rows of the token-wise chains per micro-batch
    by_layer: dict[str, list[dict]] = {}
    for f in fusions:
        if f["pattern"] not in _NOT_IN_LAYERS:
            by_layer.setdefault(f["layer"], []).append(f)
    layers = []
    for layer in spec.layers:
        chains = by_layer.get(layer.name)
        saved = (fusion_savings_by_layer(chains, tokens, dtype_bytes=spec.dtype_bytes or 2, seq=seq,
                                         heads=(layer.attrs or {}).get("heads")).get(layer.name)
                 if chains else None)
        if not saved or (saved["fwd_saved"] == 0 and saved["bwd_saved"] == 0):
            layers.append(layer)
            continue
        fused = copy.copy(layer)
        # added to what the spec already saves (an engine's own fused modules, autopar.engine)
        fused.fused_bytes_saved_fwd = layer.fused_bytes_saved_fwd + saved["fwd_saved"]
        fused.fused_bytes_saved_bwd = layer.fused_bytes_saved_bwd + saved["bwd_saved"]
        if layer.signature:
            # identical blocks fuse identically and keep sharing solver variables;
            # a block fused differently must not share an unfused block's costs
            digest = hashlib.sha1(f"{saved['fwd_saved']}|{saved['bwd_saved']}".encode()).hexdigest()[:10]
            fused.signature = f"{layer.signature}|fused:{digest}"
        layers.append(fused)
    out = copy.copy(spec)
    out.layers = layers
    return out


def charge_compiled_blocks(spec):
    """`spec` as autopar's program runs it with its blocks torch.compile'd (copies):
    each block's memory-bound ops fused as inductor fuses a whole block graph
    (LayerSpec.compiled_fusion_saved_*, measured by capture on the layer's
    dataflow; the chains the fusion pass charged are among them, so the larger
    of the two saving counts, never their sum), and the host time of the
    kernels that graph launches instead of every eager op (attrs
    "compiled_kernels_fwd"; backward as twice as many). Blocks are the layers
    that repeat (a stack's, by signature); embeddings and head stay eager, as
    the lowering runs them."""
    repeats = Counter(l.signature for l in spec.layers if l.signature)
    layers = []
    for layer in spec.layers:
        kernels = (layer.attrs or {}).get("compiled_kernels_fwd")
        if layer.kind in ("embedding", "head") or repeats.get(layer.signature, 0) < 2 or not kernels:
            layers.append(layer)
            continue
        compiled = copy.copy(layer)
        compiled.fused_bytes_saved_fwd = _larger(layer.fused_bytes_saved_fwd, layer.compiled_fusion_saved_fwd)
        compiled.fused_bytes_saved_bwd = _larger(layer.fused_bytes_saved_bwd, layer.compiled_fusion_saved_bwd)
        compiled.attrs = {**layer.attrs, "host_ops_fwd": kernels, "host_ops_bwd": 2 * kernels}
        compiled.signature = f"{layer.signature}|compiled"
        layers.append(compiled)
    out = copy.copy(spec)
    out.layers = layers
    return out


def _larger(a, b):
    """The larger of two byte counts in (b, s): compared at a mid-size point, both polynomials with
    nonnegative terms, so the one larger there is taken (exact where one saves a superset)."""
    from cost_models.compute import fast
    return a if fast(a)(8, 2048) >= fast(b)(8, 2048) else b
