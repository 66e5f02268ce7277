"""The fusion pass: find fusable chains in a model, record them, swap them in.

`find_fusions(model)` traces each layer module (each element of the model's
block `nn.ModuleList`s, or the modules a ModelGraph's layers name) with
torch.fx and matches the memory-bound chains that eager PyTorch runs as
several kernels:

  pattern          chain in the block's graph                    kernel
  bias_gelu        Linear(bias) -> gelu                          (none: found for other engines)
  bias_silu        Linear(bias) -> silu                          (none: found for other engines)
  swiglu           silu(a) * b                                   swiglu
  add_layernorm    x + y -> LayerNorm                            add_layernorm
  add_rmsnorm      x + y -> RMSNorm (torch's or a Llama-style)   add_rmsnorm
  scaled_softmax   softmax((s * c).masked_fill(m, -inf)) / softmax(s * c)
                                                                scaled_masked_softmax
  dropout_add      Dropout(x) + y                                dropout_add
  linear_cross_entropy  the model's output Linear (recorded for the loss path)

Each match is a plain dict (JSON-ready, stored in `Plan.fusions`):
  {"layer", "module", "pattern", "kernel", "anchor", "modules", "ops",
   "scope", "target", "width", "params"}
`layer` is the ModelGraph layer the chain belongs to (its name; without a
graph, the module path, which is how capture names a one-module layer);
`module` is the layer's module that was traced; `target` is the sub-module
(relative to `module`) that contains the whole chain and is rewritten;
`anchor` identifies the chain inside the layer by a stable name (see
`_stable_anchors`); `width` is the row width the kernel runs on (None where
it is only known at run time, e.g. softmax keys).

`apply_fusions(model, fusions, compiled=...)` swaps in the chains autopar runs
with its own kernel when the blocks run so (`autopar.kernels.RUNS`: where the
kernel beats eager, or beats inductor's own fusion of the chain), rewrites each target module in place and
returns the model: the target becomes an fx GraphModule with the same
submodules and parameter names, matched modules get their fused class
(`fused_modules.swap_class`), and only the modules a chain lives in are
traced through (the rest stay leaf calls, so e.g. `self.training` checks in
attention still run at call time, and a block still calls its attention
and MLP modules). `linear_cross_entropy` is not applied here: the loss
lives outside the model; the lowering's loss path calls
`autopar.kernels.linear_cross_entropy(hidden, head.weight, targets)`.

`fusion_bytes(fusion, rows, ...)` gives the HBM bytes each chain moves
unfused (eager) and fused, for the cost model.

Each pattern's matching and rewriting is its own module in
autopar/kernels/patterns/; recognising ops is autopar/kernels/fx_ops.py.
"""
from __future__ import annotations

from typing import Iterable

import torch.fx as fx
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.kernels import RUNS, patterns
from autopar.kernels.fx_ops import is_norm

PATTERNS = ("bias_gelu", "bias_silu", "swiglu", "add_layernorm", "add_rmsnorm", "scaled_softmax",
            "dropout_add", "linear_cross_entropy")


class _Tracer(fx.Tracer):
    """Treats norms as leaves (they are matched as modules). With `open_paths`
    given, every module outside it is a leaf too: only the scopes a chain
    lives in are inlined."""

    def __init__(self, open_paths: set[str] | None = None):
        super().__init__()
        self.open_paths = open_paths
        # buffers as graph values (get_attr), so `self.mask[:s, :s]` with a
        # traced `s` works instead of slicing a real tensor by a proxy
        self.proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if is_norm(m):
            return True
        if self.open_paths is not None and qualname not in self.open_paths:
            return True
        return super().is_leaf_module(m, qualname)


def _trace(block: nn.Module, open_paths: set[str] | None) -> fx.Graph | None:
    try:
        return _Tracer(open_paths).trace(block)
    except Exception:
        if open_paths is None:  # data-dependent code somewhere inside: see the block's own forward only
            try:
                return _Tracer(set()).trace(block)
            except Exception:
                return None
        return None


def _scope(n: fx.Node) -> str:
    """Module path (relative to the traced block) whose forward created node n."""
    if n.op == "call_module":
        return n.target.rpartition(".")[0]
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.keys())[-1].split("@")[0]


# -- matching -------------------------------------------------------------------

def _match(graph: fx.Graph, modules: dict, prefix: str = "") -> list[dict]:
    """All chains in one traced module's graph, as {pattern, anchor, scope,
    nodes, ...}; a node belongs to at most one chain (add+norm is matched
    before dropout+add). `prefix` is the traced module's path inside the
    layer module, so anchors and scopes read the same whichever module of the
    layer was traced (see `_stable_anchors`)."""
    found = _match_chains(graph, modules)
    _stable_anchors(found, prefix)
    for m in found:
        m["modules"] = [prefix + p for p in m["modules"]]
        m["ops"] = [prefix + o if o in modules else o for o in m["ops"]]
    return found


def _join(prefix: str, path: str) -> str:
    return (prefix + path) if path else prefix.rstrip(".")


def _stable_anchors(found: list[dict], prefix: str) -> None:
    """Anchor = the module a chain is built around (a norm, a Linear), as a
    path inside the layer; for chains of functions only, "<scope>:<pattern>#k"
    (the k-th such chain in that module's own forward). fx node names would
    not do: they count ops over the whole trace, so they shift when another
    sub-module is inlined or kept a leaf."""
    seen: dict[tuple, int] = {}
    for m in found:
        m["scope"] = sorted({_join(prefix, _scope(x)) for x in m["nodes"]})
        if m["anchor"] is not None:
            m["anchor"] = prefix + m["anchor"]
            continue
        scope = _join(prefix, _scope(m["nodes"][-1]))
        k = seen.get((m["pattern"], scope), 0)
        seen[(m["pattern"], scope)] = k + 1
        m["anchor"] = f"{scope}:{m['pattern']}#{k}"


def _match_chains(graph: fx.Graph, modules: dict) -> list[dict]:
    found: list[dict] = []
    used: set[fx.Node] = set()
    nodes = list(graph.nodes)
    for pattern in patterns.IN_ORDER:
        found += pattern.match(nodes, modules, used)
    return found


def _common_scope(scopes: list[str]) -> str:
    parts = [sc.split(".") if sc else [] for sc in scopes]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _record(layer: str, module: str, match: dict) -> dict:
    kernel = {"scaled_softmax": "scaled_masked_softmax"}.get(match["pattern"], match["pattern"])
    return {
        "layer": layer,
        "module": module,
        "pattern": match["pattern"],
        "kernel": kernel,
        "anchor": match["anchor"],
        "modules": [f"{module}.{p}" if module else p for p in match["modules"]],
        "ops": list(match["ops"]),
        "scope": match["scope"],
        "target": _common_scope(match["scope"]),  # the sub-module apply_fusions rewrites
        "width": match["width"],
        "params": dict(match["params"]),
    }


# -- which modules are layers ---------------------------------------------------

def layer_modules(model: nn.Module, graph=None) -> list[tuple[str, str, nn.Module]]:
    """(layer name, module path, module) for each module the pass traces: the
    paths a ModelGraph's layers name (when given), else every element of the
    model's ModuleLists/Sequentials that is not inside another one, else the
    model itself."""
    named = dict(model.named_modules())
    if graph is not None and getattr(graph, "layers", None):
        out = []
        for layer in graph.layers:
            for p in getattr(layer, "module_paths", None) or [layer.name]:
                if p in named and p:
                    out.append((layer.name, p, named[p]))
        return out
    out, taken = [], []
    for path, m in model.named_modules():
        if any(path.startswith(t + ".") for t in taken):
            continue
        if isinstance(m, (nn.ModuleList, nn.Sequential)):
            for name, child in m.named_children():
                p = f"{path}.{name}" if path else name
                out.append((p, p, child))
            taken.append(path)
    return out or [("", "", model)]


def _output_head(model: nn.Module) -> dict | None:
    """The Linear whose output is the model's output (the LM head), if any: found
    by tracing the model's own forward (layers as leaves); when that forward
    does not trace (e.g. it slices a buffer by an input's size), the last
    direct-child Linear of the model, the usual place of an LM head."""
    path = None
    g = _trace(model, open_paths={""})
    if g is not None:
        out = next(n for n in g.nodes if n.op == "output").args[0]
        if isinstance(out, fx.Node) and out.op == "call_module":
            path = out.target
    else:
        linears = [n for n, c in model.named_children() if isinstance(c, nn.Linear)]
        path = linears[-1] if linears else None
    lin = dict(model.named_modules()).get(path) if path else None
    if not isinstance(lin, nn.Linear) or lin.bias is not None:
        return None
    return {"layer": path, "module": path, "pattern": "linear_cross_entropy", "kernel": "linear_cross_entropy",
            "anchor": path, "modules": [path], "ops": [path, "cross_entropy"], "scope": [""], "target": "",
            "width": lin.out_features, "params": {"hidden": lin.in_features, "applied_by": "loss"}}


# -- public API -----------------------------------------------------------------

def find_fusions(model, graph=None, *, patterns: Iterable[str] = PATTERNS) -> list[dict]:
    """Fusable chains of `model` (an nn.Module; a ModelGraph may be passed as
    `graph` to take the layer list from it). Deterministic order: layers in
    model order, chains in pattern order within a layer."""
    if not isinstance(model, nn.Module) and hasattr(model, "layers"):  # a ModelGraph
        module = getattr(model, "module", None) or getattr(model, "model", None)
        if not isinstance(module, nn.Module):
            raise AutoparError(
                "find_fusions needs the model's modules to trace; a ModelGraph alone does not carry them",
                hint="call find_fusions(model, graph) with the nn.Module and its ModelGraph",
            )
        model, graph = module, model
    if not isinstance(model, nn.Module):
        raise AutoparError(f"find_fusions expects an nn.Module, got {type(model).__name__}")
    patterns = set(patterns)
    unknown = patterns - set(PATTERNS)
    if unknown:
        raise AutoparError(f"unknown fusion pattern(s): {', '.join(sorted(unknown))}", hint=f"known: {', '.join(PATTERNS)}")
    out = []
    layers = layer_modules(model, graph)
    for layer, path, block in layers:
        g = _trace(block, None)
        if g is None:
            continue
        for match in _match(g, dict(block.named_modules())):
            if match["pattern"] in patterns:
                out.append(_record(layer, path, match))
    if "linear_cross_entropy" in patterns:
        head = _output_head(model)
        if head is not None:
            owner = [lay for lay, p, _ in layers if head["module"] == p or head["module"].startswith(p + ".")]
            head["layer"] = owner[0] if owner else head["module"]
            out.append(head)
    return out


def _open_paths(records: list[dict], target: str) -> set[str]:
    """Module paths (relative to `target`) the trace must inline: every
    prefix of every scope a chain lives in. Everything else stays a leaf."""
    paths = {""}
    for r in records:
        for sc in r["scope"]:
            rel = sc[len(target):].lstrip(".") if target else sc
            parts = rel.split(".") if rel else []
            for i in range(len(parts) + 1):
                paths.add(".".join(parts[:i]))
    return paths


def _rewrite(graph: fx.Graph, modules: dict, match: dict, block: nn.Module | None = None) -> None:
    patterns.BY_PATTERN[match["pattern"]].rewrite(graph, modules, match, block)


def _keep_non_persistent(old: nn.Module, new: nn.Module) -> None:
    # GraphModule re-registers copied buffers as persistent; restore the
    # original flags so state_dict keys do not change.
    for path, m in old.named_modules():
        for name in m._non_persistent_buffers_set:
            try:
                owner = new.get_submodule(path) if path else new
            except AttributeError:
                continue
            if name in owner._buffers:
                owner._non_persistent_buffers_set.add(name)


def _keep_all_state(old: nn.Module, new: nn.Module) -> None:
    # GraphModule copies only what the graph reads; a buffer the rewrite made
    # unused (a proven-causal mask) must stay, or state_dict keys change.
    for path, m in old.named_modules():
        for attr in ("_parameters", "_buffers"):
            for name, t in getattr(m, attr).items():
                owner = new
                for part in path.split(".") if path else []:
                    if part not in owner._modules:
                        owner._modules[part] = nn.Module()
                    owner = owner._modules[part]
                if name not in getattr(owner, attr) and name not in owner._modules:
                    getattr(owner, attr)[name] = t
                    if name in m._non_persistent_buffers_set:
                        owner._non_persistent_buffers_set.add(name)


def _keep_order(old: nn.Module, new: nn.Module) -> None:
    # GraphModule registers submodules in call order; restore definition
    # order so named_parameters() (optimizer groups, FSDP / DDP buckets,
    # checkpoints saved by position) is exactly the original's.
    for path, m in old.named_modules():
        try:
            target = new.get_submodule(path) if path else new
        except AttributeError:
            continue
        if target is m:
            continue  # a shared leaf: already the original object
        for attr in ("_modules", "_parameters", "_buffers"):
            have = getattr(target, attr)
            order = [k for k in getattr(m, attr) if k in have] + [k for k in have if k not in getattr(m, attr)]
            reordered = {k: have[k] for k in order}
            have.clear()
            have.update(reordered)


def apply_fusions(model: nn.Module, fusions: list[dict], *, compiled: bool = False) -> nn.Module:
    """Rewrite `model` in place so the listed chains run fused; returns it.

    Only the chains autopar has a kernel for that wins where the blocks run
    (`RUNS["compiled"]` when they are torch.compile'd, else `RUNS["eager"]`) are
    swapped in; the rest stay as the model wrote them. Parameter and buffer names
    are unchanged. Entries whose layer or chain is not found (a different model, or
    a layer that no longer traces) are skipped, never half-applied;
    `linear_cross_entropy` entries are for the loss path and are skipped here."""
    if not isinstance(model, nn.Module):
        raise AutoparError(f"apply_fusions expects an nn.Module, got {type(model).__name__}")
    runs = RUNS["compiled" if compiled else "eager"]
    groups: dict[str, list[dict]] = {}
    for f in fusions:
        if not isinstance(f, dict) or "module" not in f or "pattern" not in f or "anchor" not in f:
            raise AutoparError(f"apply_fusions: malformed fusion record {f!r}",
                               hint="pass the dicts find_fusions returned (Plan.fusions)")
        if f.get("params", {}).get("applied_by") == "loss" or f["pattern"] not in runs:
            continue
        target = f.get("target", "")
        groups.setdefault(_join(f["module"] + "." if f["module"] else "", target), []).append(f)
    # Deepest modules first; a rewritten parent calls its children by name,
    # so the order does not change the result, only what each trace sees.
    new_root = model
    for path in sorted(groups, key=lambda p: (-(p.count(".") + 1 if p else 0), p)):
        records = groups[path]
        try:
            target_module = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        target = records[0].get("target", "")
        graph = _trace(target_module, _open_paths(records, target))
        if graph is None:
            continue
        modules = dict(target_module.named_modules())
        wanted = {(r["pattern"], r["anchor"]) for r in records}
        matches = [m for m in _match(graph, modules, prefix=target + "." if target else "")
                   if (m["pattern"], m["anchor"]) in wanted]
        if not matches:
            continue
        for m in matches:
            _rewrite(graph, modules, m, target_module)
        graph.lint()
        gm = fx.GraphModule(target_module, graph, class_name=f"Fused{type(target_module).__name__}")
        _keep_all_state(target_module, gm)
        _keep_non_persistent(target_module, gm)
        _keep_order(target_module, gm)
        gm.train(target_module.training)
        if not path:
            new_root = gm
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        parent._modules[name] = gm
    return new_root


# -- bytes for the cost model ---------------------------------------------------
# HBM traffic per row, in units of (width x element bytes), outside any GEMM
# (a GEMM's own reads are the same fused or not; its output write is counted
# where the chain reads it back). (fwd_unfused, fwd_fused, bwd_unfused, bwd_fused)
_TRAFFIC = {
    # addmm writes y, gelu reads y writes z | gelu' reads dz,y writes dy, bias grad reads dy
    "bias_gelu": (3, 3, 4, 3),
    "bias_silu": (3, 3, 4, 3),
    # silu r a w s, mul r s,b w o | mul' 2x(r 2 w 1), silu' r ds,a w da ; fused r a,b w o | r do,a,b w da,db
    "swiglu": (5, 3, 9, 5),
    # add r x,r w h; norm r h w y | norm' r dy,h w dx (+ r dy,h for dw/db); add' r dx,dres w sum
    "add_layernorm": (5, 4, 8, 4),
    "add_rmsnorm": (5, 4, 8, 4),
    # mul r w, masked_fill r w, softmax r w | softmax' r dp,p w, masked_fill' r w, mul' r w
    "scaled_softmax": (6, 2, 7, 3),
    # dropout r x w y (+mask), add r y,r w o | dropout' r dy (+mask) w dx
    "dropout_add": (5, 3, 2, 2),
    # head writes logits, log_softmax r w | nll' w, log_softmax' r 2 w 1 ; fused: chunk logits w, CE r 2 w 1 | none
    "linear_cross_entropy": (3, 4, 4, 0),
}


def fusion_bytes(fusion: dict, rows, width=None, dtype_bytes: int = 2) -> dict:
    """HBM bytes one fused chain moves per micro-batch, eager vs fused.

    rows: rows the kernel runs over (tokens per micro-batch, b*s, for every
      pattern but scaled_softmax, whose rows are b*heads*s); a number or a
      sympy expression (workload.B, workload.S).
    width: the row width; defaults to the record's `width` (softmax: keys, s).
    Returns {fwd_unfused, fwd_fused, bwd_unfused, bwd_fused, saved} in bytes;
    dropout's 1-byte mask (written in forward, read in backward by eager,
    never by the fused kernel) is included.
    """
    pattern = fusion["pattern"]
    if pattern not in _TRAFFIC:
        raise AutoparError(f"fusion_bytes: unknown pattern {pattern!r}", hint=f"known: {', '.join(_TRAFFIC)}")
    width = width if width is not None else fusion.get("width")
    if width is None:
        raise AutoparError(f"fusion_bytes: the {pattern} chain in {fusion.get('layer')!r} has no static width",
                           hint="pass width= (e.g. the sequence length for scaled_softmax)")
    unit = rows * width * dtype_bytes
    fu, ff, bu, bf = _TRAFFIC[pattern]
    out = {"fwd_unfused": fu * unit, "fwd_fused": ff * unit, "bwd_unfused": bu * unit, "bwd_fused": bf * unit}
    if pattern == "dropout_add":
        mask = rows * width  # bool mask, one byte per element
        out["fwd_unfused"] += mask
        out["bwd_unfused"] += mask
    out["saved"] = out["fwd_unfused"] + out["bwd_unfused"] - out["fwd_fused"] - out["bwd_fused"]
    return out


def fusion_savings_by_layer(fusions: list[dict], tokens, *, dtype_bytes: int = 2, seq=None, heads=None) -> dict:
    """Bytes the fused chains save per ModelGraph layer and micro-batch:
    {layer: {"fwd_saved", "bwd_saved"}} (each may be a sympy expression).

    tokens: rows of the token-wise chains (b*s per micro-batch, e.g.
      workload.B * workload.S). scaled_softmax needs `seq` and `heads`
      (its rows are tokens * heads, its width seq); without them it is left out.
    """
    out: dict[str, dict] = {}
    for f in fusions:
        if f["pattern"] == "scaled_softmax":
            if seq is None or heads is None:
                continue
            b = fusion_bytes(f, rows=tokens * heads, width=seq, dtype_bytes=dtype_bytes)
        elif f.get("width") is None:
            continue
        else:
            b = fusion_bytes(f, rows=tokens, dtype_bytes=dtype_bytes)
        entry = out.setdefault(f["layer"], {"fwd_saved": 0, "bwd_saved": 0})
        entry["fwd_saved"] += b["fwd_unfused"] - b["fwd_fused"]
        entry["bwd_saved"] += b["bwd_unfused"] - b["bwd_fused"]
    return out
