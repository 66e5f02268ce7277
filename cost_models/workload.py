"""The workload: what a model asks of the hardware, layer by layer.

These types are the currency between capture (which measures them from a
traced graph) and the cost models (which price them on a cluster under a
layout). They live here, not in autopar, so that cost_models stays pure and
can price hand-written analytic models too (see `analytic.py`).

Quantities that depend on the micro-batch size or sequence length are sympy
expressions in the symbols `B` (samples per micro-batch) and `S` (sequence
length); a model without a sequence axis (ResNet, ViT) simply has no `S` in
its expressions. `evaluate(expr, batch, seq)` turns one into a number; hot
loops should use `LayerSpec.fn(field)` which caches a lambdified function.

Conventions (all per *one* micro-batch of B samples, no parallelism, no
activation checkpointing, at the dtype the model was captured in, which is
the training compute dtype, normally bf16):
- FLOPs count a multiply-add as 2 FLOPs; causal attention is counted
  unmasked (as FlopCounterMode and Megatron's formulas do).
- bwd_flops = FLOPs of the backward pass (about 2x forward for GEMMs).
- activation_bytes = bytes saved for backward by this layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

import sympy

B = sympy.Symbol("b", positive=True, integer=True)  # samples per micro-batch
S = sympy.Symbol("s", positive=True, integer=True)  # sequence length

Expr = Any  # sympy.Expr or a plain number


def evaluate(expr: Expr, batch: int, seq: int | None = None) -> float:
    """Numeric value of a workload expression at micro-batch `batch`, sequence `seq`."""
    if isinstance(expr, (int, float)):
        return float(expr)
    subs = {B: batch}
    if seq is not None:
        subs[S] = seq
    return float(sympy.sympify(expr).subs(subs))


@lru_cache(maxsize=None)
def _lambdify(expr) -> Callable[[float, float], float]:
    # Keyed by the expression itself (sympy expressions hash structurally):
    # printing it to a string for the key cost more than the lookup saved.
    return sympy.lambdify((B, S), sympy.sympify(expr, locals={"b": B, "s": S}), "math")


def fast(expr: Expr) -> Callable[[float, float], float]:
    """A cached plain-Python function f(batch, seq) for `expr` (for hot loops)."""
    if isinstance(expr, (int, float)):
        value = float(expr)
        return lambda b, s: value
    return _lambdify(expr)


@dataclass
class OpSpec:
    """One op (or a group of identical ops) of a layer, as the roofline sees it.

    kind: 'gemm' | 'attention' | 'elementwise' | 'norm' | 'softmax' |
          'embedding' | 'reduction' | 'other'
    gemm: (m, n, k) of the forward GEMM for kind 'gemm' (batch dims folded
          into m), else None. Used for size-dependent GEMM efficiency.
          A batched matmul (attention scores) may give (m, n, k, batch) so
          its backward is priced as batched GEMMs too.
    tp_sharded: True if tensor parallelism divides this op's work by tp
          (inside a column->row parallel region, or a vocab-sharded
          embedding/head); False for ops that only sequence parallelism
          divides (norms, residual adds, dropout outside the region).
    """

    name: str
    kind: str
    fwd_flops: Expr = 0
    bwd_flops: Expr = 0
    fwd_bytes: Expr = 0  # bytes read + written in forward
    bwd_bytes: Expr = 0
    gemm: tuple | None = None
    tp_sharded: bool = False
    # True for ops downstream of a tensor-parallel all-gather (see LayerSpec.tp_gather_bytes):
    # every tp rank runs them in full, and sequence parallelism does not split them either.
    tp_replicated: bool = False
    count: int = 1  # identical ops folded into this entry (flops/bytes are totals)
    # kind 'attention' only: True/None = causal (a flash kernel skips the masked
    # half, priced at half the unmasked FLOPs counted above), False = full.
    causal: bool | None = None
    # kind 'attention' only: which fused kernel runs it (None: FlashAttention-2's
    # generation, what torch's SDPA runs today; see compute.ATTENTION_IMPL_SPEED).
    impl: str | None = None
    # kind 'gemm' only: the forward GEMM of an nn.Linear module on its own weight (gemm =
    # (tokens, out_features, in_features)), which float8 training can run in float8
    # (cost_models/float8.py); its name is "<module path relative to the layer's
    # LayerSpec.op_prefix>:<op>"
    linear: bool = False
    # a column GEMM whose output the model cuts into this many pieces: under tp its weight
    # is split piecewise and the lowering runs the GEMM itself, not the module's forward
    tp_pieces: int = 1
    # kind 'gemm', tp_sharded: which dim tensor parallelism splits, "column" (n) or "row"
    # (k), as the capture's dataflow found; "": not known (a hand-written model), guessed
    # from the shape (compute.gemm_dims)
    tp_split: str = ""


@dataclass
class LayerSpec:
    """A layer: the unit a plan places (embedding, transformer block, head...).

    Public names (users and other stages rely on them): name, kind, params,
    param_bytes, fwd_flops, bwd_flops, activation_bytes, output_bytes.

    kind: 'embedding' | 'transformer_block' | 'attention' | 'mlp' |
          'moe_block' | 'norm' | 'conv_stage' | 'head' | 'loss' | 'other'
    attrs: shape facts the cost model and the tensor-parallel styles need,
          e.g. hidden, heads, kv_heads, head_dim, ffn_hidden, vocab_size,
          experts, top_k, seq_len (when fixed by the model).
    tp_allreduces: all-reduces (of the layer's output size) that tensor
          parallelism adds to one forward pass of this layer (Megatron: 2 for
          a transformer block, 1 for a vocab-parallel embedding); backward
          adds the same number again.
    tp_gather_bytes: bytes per forward pass (one micro-batch, unsharded size)
          of activations that tensor parallelism must all-gather because the
          model splits a column-sharded dimension into pieces (GPT's fused
          `qkv(x).split(hidden, dim=-1)`: DTensor cannot keep the split
          sharded, so every tp rank receives all of q, k and v and runs the
          whole attention core). Backward pays a matching reduce-scatter.
          0 for head-parallel layouts (Llama's separate wq/wk/wv, Megatron's
          view-then-split), which stay sharded.
    tp_collectives: the collectives the lowering issues for one micro-batch
          of this layer split over tp ranks, counted on a fake process group
          (autopar.lower.what_runs) rather than inferred:
          {"2": {"plain": ((kind, bytes, "fwd" | "bwd"), ...), "sp": ...}}
          (keys: tp degrees as strings, "sp" under sequence parallelism),
          kind as in cost_models.comm.collective_time, bytes per byte of the
          layer's output (`output_bytes`, so any micro-batch and sequence).
          Where it holds the layout's tp degree (and sequence parallelism),
          the cost model prices these instead of `tp_allreduces` and
          `tp_gather_bytes`. Empty: not checked (a ModelSpec built by hand,
          or planned inside a process group).
    ep_routed_tokens: an MoE layer's (token, chosen expert) rows per micro-batch,
          tokens x top_k: what each all-to-all of expert parallelism moves,
          `attrs["moe_hidden"]` wide (cost_models/expert_parallel.py). 0 for a
          dense layer. ep_expert_fwd_flops / ep_expert_bwd_flops: the part of
          fwd_flops / bwd_flops the experts compute (0 for a dense layer).
          attrs of an MoE layer (autopar/capture/moe.py): experts,
          top_k, moe_hidden, expert_param_bytes, dense_param_bytes,
          shared_experts, shared_expert_param_bytes, router_param_bytes,
          experts_form ("fused" 3-D weights or "module_list").
    tp_degrees: tensor-parallel sizes this layer can be split into
          (heads, kv heads, ffn and vocab divisible), 1 always included.
    signature: equal for layers that are identical up to their name (the
          solver shares variables between them).
    shared_params: names of parameters this layer uses but another layer
          owns (tied weights); they are counted once, at the owner.
    fused_bytes_saved_fwd / fused_bytes_saved_bwd: bytes of HBM traffic
          per micro-batch (unsharded, at the captured dtype, like OpSpec
          bytes) that the plan's fused kernels remove from this layer's
          memory-bound ops (bias+GELU, add+norm, ...) in forward / backward.
          0 = the eager op chain (capture measures eager traffic; a planner
          that fuses sets these, see autopar.kernels.fusion). The cost model
          takes them off the byte time of the layer's non-GEMM ops, never
          below those ops' launch floor.
    module_fusion_saved_fwd / module_fusion_saved_bwd: the bytes those ops
          would lose if each chain of memory-bound ops in a module ran as one kernel
          (capture measures them; an engine with its own fused kernels, such
          as Megatron's, adds them to fused_bytes_saved_*). Not charged
          by themselves.
    compiled_fusion_saved_fwd / compiled_fusion_saved_bwd: the same with each
          chain spanning the whole layer, as inductor fuses a compiled block
          (attrs["compiled_kernels_fwd"]: the kernels it then launches). Charged
          for the blocks of a plan priced compiled (cost_models/layer_compute.py).
    """

    name: str
    kind: str
    params: int
    param_bytes: int
    fwd_flops: Expr
    bwd_flops: Expr
    activation_bytes: Expr
    output_bytes: Expr
    input_bytes: Expr = 0  # what full checkpointing keeps (the layer's input)
    activation_bytes_tp_sharded: Expr = 0  # part of activation_bytes TP divides by tp
    activation_bytes_selective: Expr = 0  # part selective checkpointing drops (attention core)
    selective_recompute_flops: Expr = 0  # forward FLOPs selective checkpointing redoes
    # Part of activation_bytes_selective that is also in activation_bytes_tp_sharded;
    # None = all of it (Megatron's head-parallel core). GPT's gathered core: 0.
    activation_bytes_selective_tp_sharded: Expr | None = None
    # Part of activation_bytes downstream of a tp gather (GPT's attention core after the
    # qkv split): whole on every tp rank, which sequence parallelism does not divide either;
    # and the part of activation_bytes_selective that is such.
    activation_bytes_tp_gathered: Expr = 0
    activation_bytes_selective_tp_gathered: Expr = 0
    tp_allreduces: int = 0
    tp_gather_bytes: Expr = 0  # see the class docstring
    ep_routed_tokens: Expr = 0  # see the class docstring
    ep_expert_fwd_flops: Expr = 0  # the experts' part of fwd_flops / bwd_flops (MoE)
    ep_expert_bwd_flops: Expr = 0
    tp_collectives: dict = field(default_factory=dict)  # see the class docstring
    tp_degrees: tuple = (1,)
    ops: list = field(default_factory=list)  # list[OpSpec]
    attrs: dict = field(default_factory=dict)
    signature: str = ""
    module_paths: list = field(default_factory=list)
    shared_params: list = field(default_factory=list)
    # the module path its ops' names are relative to: a block's own path (so identical
    # blocks have identical ops), "" for the layers before and after the blocks
    op_prefix: str = ""
    fused_bytes_saved_fwd: Expr = 0  # see the class docstring
    fused_bytes_saved_bwd: Expr = 0
    module_fusion_saved_fwd: Expr = 0  # see the class docstring
    module_fusion_saved_bwd: Expr = 0
    compiled_fusion_saved_fwd: Expr = 0  # see the class docstring
    compiled_fusion_saved_bwd: Expr = 0

    def eval(self, name: str, batch: int = 1, seq: int | None = None) -> float:
        """Numeric value of field `name` at a micro-batch of `batch` samples."""
        return evaluate(getattr(self, name), batch, seq)


@dataclass
class ModelSpec:
    """An ordered list of layers plus the few model-wide facts costs need."""

    name: str
    layers: list  # list[LayerSpec], in execution order
    seq_len: int | None = None  # None for models without a sequence axis
    dtype_bytes: int = 2  # bytes per element of the captured activations
    tokens_per_sample: int = 1  # seq_len for language models

    @property
    def total_params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def total(self, field_name: str, batch: int = 1) -> float:
        return sum(layer.eval(field_name, batch, self.seq_len) for layer in self.layers)

    def tied_layers(self) -> list[bool]:
        """Per layer: does it hold either end of a weight tied to another layer (the
        layer naming it in `shared_params`, or the one whose module owns it)?"""
        shared = [name for layer in self.layers for name in (getattr(layer, "shared_params", None) or [])]
        return [bool(getattr(layer, "shared_params", None))
                or any(n == p or n.startswith(p + ".") for n in shared for p in (layer.module_paths or []))
                for layer in self.layers]
