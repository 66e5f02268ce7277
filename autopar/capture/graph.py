"""ModelGraph: the captured model, layer by layer, plus its forward op graph."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cost_models.workload import ModelSpec, evaluate

# LayerSpec fields that are expressions in B and S, in the order inspect shows them.
EXPR_FIELDS = ("fwd_flops", "bwd_flops", "activation_bytes", "output_bytes", "input_bytes",
               "activation_bytes_tp_sharded", "activation_bytes_selective", "selective_recompute_flops",
               "activation_bytes_selective_tp_sharded", "tp_gather_bytes", "activation_bytes_tp_gathered",
               "activation_bytes_selective_tp_gathered", "ep_routed_tokens", "ep_expert_fwd_flops",
               "ep_expert_bwd_flops")


@dataclass
class ModelGraph(ModelSpec):
    """What `autopar.capture` returns: a ModelSpec (ordered `layers`,
    `total_params`) with the forward op graph and how it was traced.

    graph: networkx.DiGraph of forward aten ops at (batch_size, seq_len); each
        node has op, kind, module, layer, in_shapes, in_dtypes, out_shapes,
        out_dtypes, flops, bytes_read, bytes_written, bytes (read + written). Blocks that share a signature were
        measured once; their nodes are copies of the representative's.
    """

    graph: Any = None
    batch_size: int = 1
    dtype: str = "bfloat16"
    notes: list = field(default_factory=list)
    capture_seconds: float = 0.0
    # How the costs depend on S: "wide" (fitted over s, s/2, s/4: any length),
    # "local" (fitted just below seq_len: lengths past any threshold the model
    # has), "none" (batch only: valid at seq_len alone).
    seq_fit: str = "wide"

    def evaluate(self, expr, batch: int = 1) -> float:
        """Value of a layer expression at `batch` samples and the captured sequence length."""
        return evaluate(expr, batch, self.seq_len)

    @property
    def total_param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def to_dict(self, batch_size: int = 1) -> dict:
        """The `inspect --json` form: numbers for one micro-batch of `batch_size`
        samples (per sample by default), plus the symbolic expressions."""
        layers = []
        for layer in self.layers:
            row = {"name": layer.name, "kind": layer.kind, "params": layer.params, "param_bytes": layer.param_bytes}
            for name in EXPR_FIELDS:
                value = self.evaluate(getattr(layer, name), batch_size)
                row[name] = int(value) if float(value).is_integer() else value
            row.update(
                tp_allreduces=layer.tp_allreduces, tp_degrees=list(layer.tp_degrees), attrs=dict(layer.attrs),
                signature=layer.signature, module_paths=list(layer.module_paths),
                shared_params=list(layer.shared_params),
                expressions={name: str(getattr(layer, name)) for name in EXPR_FIELDS},
                ops=[{"name": op.name, "kind": op.kind, "count": op.count, "tp_sharded": op.tp_sharded,
                      "tp_replicated": op.tp_replicated,
                      "gemm": [int(self.evaluate(x, batch_size)) for x in op.gemm] if op.gemm else None,
                      "fwd_flops": int(self.evaluate(op.fwd_flops, batch_size)),
                      "bwd_flops": int(self.evaluate(op.bwd_flops, batch_size))} for op in layer.ops],
            )
            layers.append(row)
        totals = {name: sum(row[name] for row in layers) for name in EXPR_FIELDS}
        return {
            "name": self.name,
            "total_params": self.total_params,
            "total_param_bytes": self.total_param_bytes,
            "batch_size": batch_size,
            "seq_len": self.seq_len,
            "dtype": self.dtype,
            "dtype_bytes": self.dtype_bytes,
            "tokens_per_sample": self.tokens_per_sample,
            "symbols": {"b": "samples per micro-batch", "s": "sequence length"},
            "totals": totals,
            "graph": {"nodes": self.graph.number_of_nodes() if self.graph is not None else 0,
                      "edges": self.graph.number_of_edges() if self.graph is not None else 0},
            "notes": list(self.notes),
            "layers": layers,
        }

    def to_json(self, batch_size: int = 1, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(batch_size), indent=indent)
