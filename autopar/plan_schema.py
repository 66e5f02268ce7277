"""What a saved plan may hold: its schema version, the vocabulary of its
choices (schedules, precisions, checkpoint modes, offloads, tp styles) and the
type of every field of its JSON.

The Plan (autopar/plan.py) checks a JSON object against this before building
itself from it, and autopar/plan_file.py checks a loaded plan's consistency in
these words; both import it, and it imports neither.
"""
from __future__ import annotations

import math

SCHEMA_VERSION = 1

# Without a pipeline (pp = 1) the micro-batches run one after another and
# accumulate gradients: that schedule has one name, `accumulate`, everywhere
# (Plan, JSON, terminal, report). Plans saved before it said "1f1b" or "gpipe".
ACCUMULATE = "accumulate"
SCHEDULES = ("gpipe", "1f1b", "interleaved", ACCUMULATE)
PRECISIONS = ("bf16", "fp16", "fp32")  # training compute dtype
CHECKPOINTS = ("none", "selective", "full")
OFFLOADS = ("none", "optimizer", "params")  # "params" offloads optimizer state too
TP_STYLES = ("replicate", "colwise_rowwise", "vocab", "sequence")
# Plan.grad_reduce_dtype: the dtype gradients cross the wire in when narrower than they
# are held (communication compression, autopar/compression.py); absent: as held
GRAD_REDUCE_DTYPES = ("bf16",)


def is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# -- types, field by field ------------------------------------------------------------------------
# What each field of a plan's JSON must hold, so a hand edit ("tp": "2", "stages": 3)
# is named with its JSON path instead of failing as a TypeError deep in the report or
# the lowering. A schema is a kind ("str", "number", ...) or (kind, schema of the
# contents): for "object" a dict of fields, for "list" the schema of every entry.
# Objects backed by a dataclass (mesh, predicted, a layer) also refuse unknown fields;
# the rest (model, cluster, solver, ...) are free-form around the fields named here.
_KINDS = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "str?": ("a string or null", lambda v: v is None or isinstance(v, str)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "number": ("a number", lambda v: is_number(v)),  # noqa: PLW0108 - is_number is defined below
    "number?": ("a number or null", lambda v: v is None or is_number(v)),
    "int": ("a non-negative integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "posint": ("a positive integer", is_positive_int),
    "posint?": ("a positive integer or null", lambda v: v is None or is_positive_int(v)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "list": ("a list", lambda v: isinstance(v, list)),
    "strlist": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "any": ("anything", lambda v: True),
}
_MESH = ("object", {"pp": "posint", "dp": "posint", "tp": "posint", "dp_shard": "posint", "ep": "posint",
                   "cp": "posint"}, "closed")
_NUMBERS = ("object", "number")  # every value a number
_COMM = ("object", {"axis": "str", "collective": "str", "tier": "str", "bytes": "number", "time_s": "number",
                    "exposed_s": "number"})
_TIMES = ("object", {"critical_pp_rank": "int", "*_s": "number"})
_PREDICTED = ("object", {"step_time_s": "number", "tokens_per_s": "number?", "samples_per_s": "number",
                         "tflops_per_gpu": "number", "mfu": "number", "peak_memory_bytes": ("list", "number"),
                         "memory_breakdown": ("list", _NUMBERS), "time_breakdown": _TIMES,
                         "comm": ("list", _COMM)}, "closed")
_LAYER = ("object", {"name": "str", "kind": "str", "module_paths": "strlist", "zero": "int",
                     "reshard_after_forward": "bool", "checkpoint": "str", "offload": "str", "tp_style": "str",
                     "float8": "strlist"},
          "closed", ("name",))
_STAGE = ("object", {"index": "int", "pp_rank": "int", "layers": ("list", _LAYER),
                     "predicted": ("object", {"*_s": "number", "*_bytes": "number",
                                              "activation_bytes_per_micro_batch": "number", "layers": "strlist"})},
          "open", ("index", "pp_rank"))
_ALTERNATIVE = ("object", {"mesh": _MESH, "schedule": "str", "virtual_stages": "posint", "micro_batch_size": "posint",
                           "num_micro_batches": "posint", "sequence_parallel": "bool", "status": "str", "why": "str",
                           "predicted": ("object", {"*_s": "number", "tflops_per_gpu": "number", "mfu": "number",
                                                    "tokens_per_s": "number?",
                                                    "peak_memory_bytes": ("list", "number")})})
# What a user of one stack alone would run (autopar/solve/baselines.py); a plan saved
# before the field has none
_BASELINE = ("object", {"stack": "str", "name": "str", "gpus": "posint", "layouts_priced": "int", "fits": "bool",
                        "status": "str", "why": "str", "vs_plan": "number?", "config": "str", "mesh": _MESH,
                        "schedule": "str", "micro_batch_size": "posint", "num_micro_batches": "posint",
                        "zero": "int", "checkpoint": "str", "offload": "str",
                        "predicted": _ALTERNATIVE[1]["predicted"]}, "open", ("stack", "fits"))
PLAN_SCHEMA = ("object", {
    "schema_version": "int",
    "model": ("object", {"name": "str?", "source": "str?", "total_params": "number", "num_layers": "int",
                         "seq_len": "posint?"}),
    "cluster": ("object", {"nodes": "posint", "gpus_per_node": "posint", "device": "str", "name": "str?",
                           "intra_node_link": "str", "inter_node_link": "str", "host_link": "str",
                           "host_memory_gib": "number", "host_memory_bandwidth_gbs": "number",
                           "world_size": "posint", "devices": "object", "links": "object", "topology": "object"}),
    "global_batch_size": "posint", "seq_len": "posint?", "precision": "str", "mesh": _MESH,
    "sequence_parallel": "bool", "schedule": "str", "virtual_stages": "posint", "micro_batch_size": "posint",
    "num_micro_batches": "posint", "grad_reduce_dtype": "str", "stages": ("list", _STAGE), "predicted": _PREDICTED,
    "alternatives": ("list", _ALTERNATIVE), "baselines": ("list", _BASELINE), "fusions": ("list", "object"),
    "solver": "object",
    "assumptions": "object",
    "constraints": ("object", {"tp": "posint", "pp": "posint", "dp": "posint", "dp_shard": "posint", "ep": "posint",
                               "cp": "posint", "micro_batch": "posint",
                               "zero": "int", "checkpoint": "str", "offload": "str", "schedule": "str",
                               "virtual_stages": "posint", "sequence_parallel": "bool", "grad_reduce_dtype": "str"}),
})


def type_problem(value, schema=PLAN_SCHEMA, path: str = "") -> str | None:
    """The first value of `value` (a plan's JSON object) of the wrong type, as
    'path must be ..., got ...', or None. Fields absent are not checked here."""
    kind, inner = (schema, None) if isinstance(schema, str) else (schema[0], schema[1])
    what, ok = _KINDS[kind]
    if not ok(value):
        return f"{path or 'the plan'} must be {what}, got {_shown(value)}"
    if inner is None:
        return None
    if kind == "list":
        for i, item in enumerate(value):
            problem = type_problem(item, inner, f"{path}[{i}]")
            if problem:
                return problem
        return None
    closed = len(schema) > 2 and schema[2] == "closed"
    required = schema[3] if len(schema) > 3 else ()
    for key in required:
        if key not in value:
            return f"{path} is missing field '{key}'"
    for key, item in value.items():
        sub = _field_schema(inner, str(key))
        where = f"{path}.{key}" if path else str(key)
        if sub is None:
            if closed:
                return f"{path} has an unknown field '{key}'"
            continue
        problem = type_problem(item, sub, where)
        if problem:
            return problem
    return None


def _field_schema(inner, key: str):
    if isinstance(inner, str) or isinstance(inner, tuple):  # every value alike
        return inner
    if key in inner:
        return inner[key]
    return next((v for k, v in inner.items() if k.startswith("*") and key.endswith(k[1:])), None)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{type(value).__name__} {text[:50]}..."


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


__all__ = ["SCHEMA_VERSION", "ACCUMULATE", "SCHEDULES", "PRECISIONS", "CHECKPOINTS", "OFFLOADS", "TP_STYLES", "GRAD_REDUCE_DTYPES",
           "PLAN_SCHEMA", "type_problem"]
