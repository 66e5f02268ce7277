"""Which forward ops tensor parallelism shards, read off the forward dataflow.

The Megatron rules, as DTensor lowering realises them
(autopar/lower/tensor_parallel.py):
- a GEMM with a weight whose activation input is full is *column*-parallel:
  its output is sharded on its last dim;
- anything computed from a sharded tensor is sharded;
- a weight GEMM fed a sharded activation is *row*-parallel (its output is full
  again, after an all-reduce). A column region that never reaches a row GEMM
  (an MoE router) is not a TP region; in the head, column regions are
  vocab-sharded logits and count.

A norm over the sharded last dim (LayerNorm, RMSNorm) ends a column region
without a row GEMM, so that region is not split (BERT's head transform).

One more rule follows the sharded dimension through layout ops: an op that
cuts a tensor into pieces *along its sharded dim* (split, chunk, slice,
narrow, unbind, select) cannot stay sharded (the pieces a rank holds are not
the pieces the model asked for), so DTensor all-gathers the input there and
everything downstream runs replicated on every rank. That is GPT's fused
`q, k, v = qkv(x).split(hidden, dim=2)`: the projections stay split, the
attention core does not. Reshaping the sharded last dim into (heads,
head_dim) first (Llama's separate wq/wk/wv, Megatron's view-then-split)
keeps the shard on the head dim, and a later split of head_dim is harmless.
A weight GEMM fed a tensor gathered from a region is still that region's
row-parallel GEMM: its input is sliced locally, no communication.

MoE experts stored as 3-D parameters (transformers' `gate_up_proj` of shape
(experts, 2 x ffn, hidden), run by `_grouped_mm` or by `linear` on
`param[e]`) fuse gate and up: `gate, up = x @ W.chunk(2, -1)`. The lowering
(autopar/lower/tp_experts.py) shards such a weight *strided*, so each rank
holds its slice of every piece (`_StridedShard(split_factor=pieces)`): an
equal cut of the column GEMM's own output keeps every piece sharded, no gather.

A fused projection reshaped into its pieces first (timm's ViT:
`qkv(x).reshape(b, n, 3, heads, head_dim)` then `unbind` along the 3) is
sharded the same way (`TPFlow.pieces`: column GEMM -> 3): strided, each rank
holds its heads of every piece, so the reshape lands the shard on the heads
dim and the cut along the pieces is free. Read in two passes: the first
finds such a cut on a pieces dim, the second reads the layer with those
column GEMMs strided.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autopar.capture import ops as opinfo
from autopar.capture.tracer import _dim_args

# _grouped_mm: MoE experts stored as one (experts, out, in) weight (transformers' grouped_mm experts).
_LINEAR_GEMMS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._grouped_mm"}
# Norms reduce over the last dim: fed a tensor sharded there, they need it whole.
_NORMS_LAST_DIM = {"aten.native_layer_norm", "aten._fused_rms_norm"}
# Ops that cut their input into pieces along `dim`.
_CUTS = {"aten.split", "aten.split_with_sizes", "aten.unsafe_split", "aten.unsafe_split_with_sizes",
         "aten.chunk", "aten.unsafe_chunk", "aten.tensor_split", "aten.slice", "aten.narrow",
         "aten.unbind", "aten.select"}
_DROPS_DIM = {"aten.unbind", "aten.select"}
_TRANSPOSES = {"aten.transpose", "aten.t", "aten.permute", "aten.movedim", "aten.swapaxes", "aten.swapdims",
               "aten.numpy_T", "aten.mT"}

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
             "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass
class TPFlow:
    """The tensor-parallel reading of one layer's forward records.

    state: record idx -> "param" | frozenset of column regions it is sharded
        by | None (full).
    sharded: record idx -> True if tp divides its work (sharded by a valid region).
    cols / rows: column GEMM records by idx / row GEMM records.
    valid: column regions that reach a row GEMM (or, in the head, all of them).
    regions: record idx -> column regions it derives from, sharded or gathered.
    gathers: (regions, nbytes) per tensor all-gathered because it was cut on its sharded dim.
    replicated: records downstream of such a gather: every tp rank computes them in
        full, even under sequence parallelism (until a row GEMM ends the region).
    sliced: gathered records that feed a row GEMM: DTensor slices them locally for
        it, so the copy autograd saves for that GEMM's backward is the 1/tp slice.
    """

    state: dict = field(default_factory=dict)
    sharded: dict = field(default_factory=dict)
    cols: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)
    valid: set = field(default_factory=set)
    regions: dict = field(default_factory=dict)
    gathers: list = field(default_factory=list)
    replicated: set = field(default_factory=set)
    sliced: set = field(default_factory=set)
    experts: set = field(default_factory=set)  # column GEMMs of MoE experts' 3-D weights
    pieces: dict = field(default_factory=dict)  # column GEMM idx -> pieces its output is reshaped into and cut

    @property
    def gather_bytes(self) -> int:
        return sum(nbytes for regions, nbytes in self.gathers if regions & self.valid)

    @property
    def expert_ffn(self) -> int | None:
        """The experts' intermediate size (the split dim of their weights): the width the
        row GEMMs fed by their column GEMMs read. None for a layer without split experts."""
        widths = [r.in_shapes[0][-1] for r in self.rows
                  if _union(self.regions.get(i) for i in r.inputs) & self.experts & self.valid]
        return min(widths) if widths else None


def _union(sets) -> frozenset:
    return frozenset().union(*[s for s in sets if isinstance(s, frozenset)])


def _norm(dim: int, ndim: int) -> int:
    """A dim as a negative index (counted from the end, as broadcasting aligns)."""
    return dim - ndim if dim >= 0 else dim


def _cut_dim(r) -> int | None:
    dims = r.dims or {}
    if "dim" not in dims or not r.in_shapes:
        return None
    return _norm(dims["dim"], len(r.in_shapes[0]))


def _is_real_cut(r, dim: int) -> bool:
    """A slice that keeps the whole dim (x[:, :]) cuts nothing."""
    if r.op in _DROPS_DIM:
        return True
    full = r.in_shapes[0][dim]
    return any(len(o) == len(r.in_shapes[0]) and o[dim] < full for o in r.out_shapes)


def _equal_pieces(r, dim: int) -> bool:
    """A cut into two or more pieces of one size along `dim` (chunk(2), an even split)."""
    if r.op in _DROPS_DIM or len(r.out_shapes) < 2:
        return False
    n = len(r.in_shapes[0])
    return (all(len(o) == n for o in r.out_shapes) and len({o[dim] for o in r.out_shapes}) == 1
            and r.out_shapes[0][dim] * len(r.out_shapes) == r.in_shapes[0][dim])


def _reshaped_dim(in_shape: tuple, out_shape: tuple, dim: int) -> int | None:
    """Where a sharded dim lands after a view/reshape: the output dim that starts the
    same trailing block of elements (the outermost piece when the dim is split into
    (heads, head_dim), the merged dim when (heads, head_dim) is flattened). None when
    the sharded dim is merged with a dim to its left (the layout is lost)."""
    d = dim + len(in_shape)
    if not 0 <= d < len(in_shape):
        return None
    block = math.prod(in_shape[d:])
    for j in range(len(out_shape)):
        if out_shape[j] != 1 and math.prod(out_shape[j:]) == block:
            return _norm(j, len(out_shape))
    return None


def _follow_dim(r, sd: int | None) -> int | None:
    """The sharded dim of r's output, given its sharded input's dim `sd` (negative)."""
    if sd is None or not r.out_shapes or not r.in_shapes:
        return None
    in_shape, out_shape = r.in_shapes[0], r.out_shapes[0]
    n_in, n_out = len(in_shape), len(out_shape)
    dims = r.dims or {}
    if r.op in _TRANSPOSES:
        if r.op == "aten.permute" and "dims" in dims:
            order = [_norm(d, n_in) for d in dims["dims"]]
            return _norm(order.index(sd), n_out) if sd in order else None
        if r.op in ("aten.transpose", "aten.swapaxes", "aten.swapdims") and "dim0" in dims:
            a, b = _norm(dims["dim0"], n_in), _norm(dims["dim1"], n_in)
            return b if sd == a else a if sd == b else sd
        if r.op in ("aten.t", "aten.numpy_T", "aten.mT") and n_in >= 2:
            return -2 if sd == -1 else -1 if sd == -2 else sd
        return None  # movedim: rare inside a region; layout unknown
    if r.op in _DROPS_DIM:
        cut = _cut_dim(r)
        return None if cut is None else sd + 1 if sd < cut else sd
    if n_in == n_out:
        return sd  # elementwise, expand, contiguous, same-rank views
    if len([s for s in r.in_shapes if s]) <= 1:
        return _reshaped_dim(in_shape, out_shape, sd)  # view, reshape, unsqueeze, flatten...
    return sd if -sd <= n_out else None  # broadcasting keeps dims aligned from the end


def _nbytes(shape: tuple, dtype: str) -> int:
    return math.prod(shape) * _ITEMSIZE.get(dtype, 2)


def _unflattened(r, sd: int | None) -> int | None:
    """The output dim holding the outer factor when a view/reshape splits the
    sharded last dim into two or more dims (…, 3C) -> (…, 3, heads, head_dim); else None."""
    if sd != -1 or r.op in _TRANSPOSES or r.op in _CUTS or len([s for s in r.in_shapes if s]) != 1 or not r.out_shapes:
        return None
    in_shape, out_shape = r.in_shapes[0], r.out_shapes[0]
    j = _reshaped_dim(in_shape, out_shape, sd)
    if j is None or j == -1 or out_shape[j] == in_shape[-1] or out_shape[j + 1] == 1:
        return None
    return j


def tp_flow(fwd: list, is_head: bool) -> TPFlow:
    """The layer's tensor-parallel reading (see the top of this file)."""
    flow = _tp_flow(fwd, is_head, {})
    if flow.pieces:  # a fused projection cut into its pieces: read again with it strided
        pieces = flow.pieces
        flow = _tp_flow(fwd, is_head, pieces)
        flow.pieces = pieces
    return flow


def _tp_flow(fwd: list, is_head: bool, pieces: dict) -> TPFlow:
    # One piece (~90 lines) on purpose: a single pass over the forward records
    # that threads seven maps of per-tensor state (sharded, its dim, its origin,
    # its pieces, gathered from); split, every part would take and return them all.
    flow = TPFlow()
    origin: dict = {}  # idx -> the column GEMM whose whole output (sharded last dim) it still is
    piece_of: dict = {}  # idx -> (column GEMM, pieces) when its sharded dim is that GEMM's pieces dim
    state, cols, rows, valid = flow.state, flow.cols, flow.rows, flow.valid
    shard_dim: dict = {}  # idx -> sharded dim of a sharded output (negative), None if unknown
    gathered: dict = {}  # idx -> regions a full (replicated) tensor was gathered from
    gathered_inputs = set()
    expert_weights = set()  # "param" records read off a 3-D (experts) parameter
    strided = flow.experts  # column GEMMs of experts' weights: an equal cut of their output stays sharded
    for r in fwd:
        act = [state.get(i) for i in r.inputs]
        from_gather = _union(gathered.get(i) for i in r.inputs)
        if r.kind == "embedding" and r.uses_param:
            st = None
        elif r.uses_param and not r.inputs:
            st = "param"
            if r.in_shapes and len(r.in_shapes[0]) == 3:
                expert_weights.add(r.idx)
        elif r.op in _LINEAR_GEMMS and (r.uses_param or "param" in act):
            sharded = _union(act)
            if sharded or from_gather:
                rows.append(r)
                valid |= sharded
                st = None
                # A replicated input is sliced locally for the row GEMM: a real TP region.
                if not sharded:
                    valid |= from_gather
                    flow.sliced |= {i for i in r.inputs if i in gathered}
            else:
                cols[r.idx] = r
                st = frozenset([r.idx])
                shard_dim[r.idx] = -1
                origin[r.idx] = r.idx
                if r.op == "aten._grouped_mm" or any(i in expert_weights for i in r.inputs):
                    strided.add(r.idx)
            from_gather = frozenset()
        elif r.out_is_int:
            st = None
        elif act and all(s == "param" for s in act):
            st = "param"
            if any(i in expert_weights for i in r.inputs):
                expert_weights.add(r.idx)
        else:
            st = _union(act) or None
            if st:
                src = next(i for i in r.inputs if isinstance(state.get(i), frozenset))
                sd = shard_dim.get(src)
                cut = _cut_dim(r) if r.op in _CUTS else None
                if r.op in _NORMS_LAST_DIM and sd == -1:
                    # A norm over the sharded dim (BERT's head: dense -> GELU -> LayerNorm
                    # -> decoder) is not a Megatron TP region: the column GEMM before it
                    # stays replicated (its region never reaches a row GEMM) and the
                    # GEMM after it starts a new column region (the vocab projection).
                    st = None
                elif cut is not None and cut == sd and src in strided and _equal_pieces(r, cut):
                    shard_dim[r.idx] = sd  # the experts' fused gate/up: each piece stays sharded
                elif (j := _unflattened(r, sd)) is not None and src in origin:
                    if origin[src] in pieces:  # strided: each rank holds its heads of every piece
                        shard_dim[r.idx] = j + 1  # the dim after the pieces (j < -1)
                    else:
                        shard_dim[r.idx] = j
                        piece_of[r.idx] = (origin[src], r.out_shapes[0][j])
                elif cut is not None and sd is not None and cut == sd and _is_real_cut(r, cut):
                    if src in piece_of and (r.op in _DROPS_DIM or _equal_pieces(r, cut)):
                        flow.pieces.setdefault(*piece_of[src])
                    # DTensor all-gathers the input before cutting it (once per tensor).
                    if src not in gathered_inputs:
                        gathered_inputs.add(src)
                        flow.gathers.append((st, _nbytes(r.in_shapes[0], r.in_dtypes[0])))
                    from_gather = from_gather | st
                    st = None
                else:
                    shard_dim[r.idx] = _follow_dim(r, sd)
                    if src in origin and shard_dim[r.idx] == -1 and r.out_shapes[0][-1:] == r.in_shapes[0][-1:]:
                        origin[r.idx] = origin[src]  # the bias add, a cast: still the whole output
                    elif src in piece_of and shard_dim[r.idx] is not None and r.op in _TRANSPOSES:
                        piece_of[r.idx] = piece_of[src]  # the pieces dim moved (timm's permute)
        state[r.idx] = st
        if from_gather and st is None:
            gathered[r.idx] = from_gather
        flow.regions[r.idx] = (st if isinstance(st, frozenset) else frozenset()) | gathered.get(r.idx, frozenset())
    if is_head:
        valid |= set(cols)
    flow.sharded = {idx: isinstance(st, frozenset) and bool(st & valid) for idx, st in state.items()}
    flow.replicated = {idx for idx, regions in gathered.items() if regions & valid}
    return flow


def split_groups(flow: TPFlow) -> list[tuple[list[int], list]]:
    """The tensor-parallel pairs of a layer: [(column GEMM idxs, row GEMM records)].

    Valid column regions that end in a common row GEMM form one group (q, k
    and v all reach the out-projection; gate and up reach down): the
    Linears of one group are split together or not at all."""
    parent = {c: c for c in flow.valid if c in flow.cols}

    def root(c):
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c
    ends = []
    for r in flow.rows:
        regions = sorted(_union(flow.regions.get(i) for i in r.inputs) & parent.keys())
        for c in regions[1:]:
            parent[root(c)] = root(regions[0])
        ends.append((r, regions[0] if regions else None))
    groups: dict = {}
    for c in sorted(parent):
        groups.setdefault(root(c), ([], []))[0].append(c)
    for r, c in ends:
        if c is not None:
            groups[root(c)][1].append(r)
    return list(groups.values())


@dataclass
class FlowOp:
    """The fields of capture's OpRecord that `tp_flow` reads, plus the module that ran the op."""

    idx: int
    op: str
    kind: str
    inputs: tuple
    uses_param: bool
    out_is_int: bool
    in_shapes: tuple
    in_dtypes: tuple
    out_shapes: tuple
    dims: dict | None
    module: object = None  # the innermost module whose forward dispatched it
    param_names: tuple = ()  # the parameters it reads itself (names in the recorded module), as OpRecord's


class ModuleFlow(TorchDispatchMode):
    """The forward records of some modules (the blocks of a model), as capture's
    tracer makes them, for `tp_flow`: the lowering reads its tensor-parallel
    pairs off the same dataflow the cost model prices (the records keep the
    innermost module of each op, so a GEMM is traced back to its Linear).
    Enter it inside FakeTensorMode; `ops[key]` holds each module's first call."""

    def __init__(self, modules: dict):
        super().__init__()
        self.ops: dict = {}
        self._current, self._stack, self._producer, self._keep, self._hooks = None, [], {}, [], []
        self._count = 0
        self._params = {key: {p.untyped_storage()._cdata: n for n, p in m.named_parameters()}
                        for key, m in modules.items()}
        self._buffers = {key: {b.untyped_storage()._cdata for b in m.buffers()} for key, m in modules.items()}
        for key, top in modules.items():
            for m in top.modules():
                self._hooks.append(m.register_forward_pre_hook(self._enter(key if m is top else None)))
                self._hooks.append(m.register_forward_hook(self._leave(m is top), always_call=True))

    def _enter(self, key):
        def hook(module, args):
            if key is not None and self._current is None and key not in self.ops:
                self._current, self.ops[key] = key, []
            self._stack.append(module)
        return hook

    def _leave(self, top: bool):
        def hook(module, args, out):
            self._stack.pop()
            if top and not self._stack:
                self._current = None
        return hook

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._keep = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self._current is None or not outs:
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # As the tracer's records: a parameter or buffer is no input of the dataflow, and a
        # tensor made outside the recorded forwards (the block's input) is one, full (-1).
        held = {id(t): t.untyped_storage()._cdata for t in ins if id(t) not in self._producer}
        params, buffers = self._params[self._current], self._buffers[self._current]
        idx = self._count
        self._count += 1
        packet = func._overloadpacket
        self.ops[self._current].append(FlowOp(
            idx=idx, op=str(packet), kind=opinfo.op_kind(packet),
            inputs=tuple(self._producer.get(id(t), -1) for t in ins
                         if held.get(id(t)) not in params and held.get(id(t)) not in buffers),
            uses_param=any(h in params for h in held.values()),
            out_is_int=not (outs[0].is_floating_point() or outs[0].is_complex()),
            in_shapes=tuple(tuple(t.shape) for t in ins),
            in_dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in ins),
            out_shapes=tuple(tuple(t.shape) for t in outs), dims=_dim_args(func, args, kwargs),
            module=self._stack[-1] if self._stack else None,
            param_names=tuple(dict.fromkeys(params[h] for h in held.values() if h in params))))
        for t in outs:
            self._producer[id(t)] = idx
        self._keep.extend(outs)  # no id is reused while the records stand
        return out
