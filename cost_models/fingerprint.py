"""What makes two layers cost the same: `layer_fingerprint`, and the fields of
the model and the layout that enter layer_cost's memo (cost_models/layer.py).

The cache key holds *everything* a layer's cost reads, derived from the
objects' fields rather than listed by hand (see the comment below).
"""
from __future__ import annotations

import itertools
import weakref

from cost_models.layout import Layout
from cost_models.workload import LayerSpec, ModelSpec

# The cache key holds *everything* a layer's cost reads, derived from the objects'
# fields rather than listed by hand: a layer's content (every LayerSpec field but its
# name and module paths, ops included), the model's scalars, every Layout field except
# those known not to change one layer's cost, and the cluster's cache key. A field
# added later to LayerSpec, OpSpec, ModelSpec or Layout therefore enters the key by
# default (a signature that forgot `fused_qkv` once returned another layer's cost).
_LAYER_FIELDS_NOT_READ = frozenset({"name", "module_paths", "signature", "op_prefix"})
_MODEL_FIELDS_NOT_READ = frozenset({"name", "layers"})
# whole-model / per-layer layout fields: layer_cost receives its zero/checkpoint/offload
# as arguments, and schedule / virtual stages / stage split only matter to the pipeline
_LAYOUT_FIELDS_NOT_READ = frozenset({"schedule", "virtual_stages", "stage_layers", "layer_zero", "layer_checkpoint",
                                     "layer_offload", "layer_float8", "zero", "checkpoint", "offload", "extra"})
_FINGERPRINT_IDS: dict = {}  # layer content -> small int (never reused: see _next_id)
_next_id = itertools.count()
_FINGERPRINT_MEMO: dict = {}  # id(layer) -> (weakref, identity of its field values, fingerprint id)


def _hashable(x):
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted(((k, _hashable(v)) for k, v in x.items()), key=repr))
    if isinstance(x, set):
        return tuple(sorted((_hashable(v) for v in x), key=repr))
    if hasattr(x, "__dataclass_fields__"):
        return (type(x).__name__,) + tuple((k, _hashable(v)) for k, v in vars(x).items())
    return x


def layer_fingerprint(layer: LayerSpec) -> int:
    """A small int equal for layers whose costs are equal by construction: same
    content in every field the cost model may read (all but name / module paths /
    signature, ops compared op by op). Memoised per layer object; re-derived when
    any field (or any op of its list) is replaced."""
    ident = tuple(map(id, vars(layer).values())) + tuple(map(id, layer.ops))
    memo = _FINGERPRINT_MEMO.get(id(layer))
    if memo is not None and memo[0]() is layer and memo[1] == ident:
        return memo[2]
    content = tuple((k, _hashable(v)) for k, v in vars(layer).items() if k not in _LAYER_FIELDS_NOT_READ)
    fid = _FINGERPRINT_IDS.get(content)
    if fid is None:
        if len(_FINGERPRINT_IDS) > 100_000:  # a cleared content gets a fresh id: a cache miss, never a collision
            _FINGERPRINT_IDS.clear()
        fid = _FINGERPRINT_IDS[content] = next(_next_id)
    if len(_FINGERPRINT_MEMO) > 100_000:
        _FINGERPRINT_MEMO.clear()
    _FINGERPRINT_MEMO[id(layer)] = (weakref.ref(layer), ident, fid)
    return fid


def _fields_key(obj, names: tuple) -> tuple:
    return tuple([getattr(obj, k) for k in names])


# the cost model's own types: fields a subclass adds (capture's ModelGraph: its op graph) are not read
_MODEL_KEY_FIELDS = tuple(k for k in ModelSpec.__dataclass_fields__ if k not in _MODEL_FIELDS_NOT_READ)
_LAYOUT_KEY_FIELDS = tuple(k for k in Layout.__dataclass_fields__ if k not in _LAYOUT_FIELDS_NOT_READ)


def layer_cost_key(layer: LayerSpec, model: ModelSpec, layout: Layout, cluster, zero: int, checkpoint: str,
                   offload: str, float8: bool | None = None):
    """The memo key of `layer`'s cost: hashable (a field holding a list or a dict is
    compared by its contents)."""
    key = (layer_fingerprint(layer), _fields_key(model, _MODEL_KEY_FIELDS), _fields_key(layout, _LAYOUT_KEY_FIELDS),
           zero, checkpoint, offload, float8, cluster.cache_key())
    try:
        hash(key)
    except TypeError:  # a field holding a list or dict: compare its contents
        key = _hashable(key)
    return key
