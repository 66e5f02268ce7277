"""Analytic GPT / Llama workloads (Megatron and Korthikanti formulas).

`transformer(...)` builds the same `ModelSpec` capture would produce for a
decoder-only transformer, from its shape alone, so published runs can be
priced without tracing 100B-parameter models and the captured zoo models can
be checked against it. Layers: `embedding`, `blocks.{i}`, `head` (final norm
+ output projection + loss).

Per block (T = b s tokens, h hidden, a heads, g kv heads, d = h / a head dim,
f ffn hidden; FLOPs count a multiply-add as 2, attention unmasked):
- GEMM FLOPs forward 2 T h (h + 2 g d) + 2 T h h + 2 T h f (x2 if gated) + 2 T f h,
  backward twice that: 24 b s h^2 forward for GPT (Megatron);
- attention core 4 b s^2 h forward (QK^T and PV), backward 8 b s^2 h;
- saved activations (Korthikanti et al. 2022, 16-bit): with dropout and an
  unfused softmax, 34 s b h + 5 a s^2 b, of which 10 s b h (norm inputs,
  GEMM inputs outside the TP region, dropout masks) is not divided by tensor
  parallelism and 5 a s^2 b is the attention core selective checkpointing drops.
  With FlashAttention the s^2 terms are never stored (it saves q, k, v, the
  output and a fp32 log-sum-exp per row and recomputes the scores).

Tensor parallelism is head-parallel by default (Megatron's own code, and
Llama's separate wq/wk/wv). `fused_qkv_split=True` prices a model written like
examples/gpt.py instead, `q, k, v = qkv(x).split(h, dim=2)`: the split cuts
the column-sharded dim, so DTensor all-gathers the qkv output
(`tp_gather_bytes`, reduce-scattered back in backward) and every tp rank runs
the whole attention core; its activations (q, k, v, scores, the attention
output) are then not divided by tp. This matches what capture measures.
"""
from __future__ import annotations

from dataclasses import dataclass

from cost_models.errors import CostModelError
from cost_models.workload import B, S, LayerSpec, ModelSpec, OpSpec

BYTES = 2  # 16-bit activations and weights (the captured training dtype)
GATHERED = "gathered"  # a saved tensor downstream of a tp all-gather: whole on every tp rank
# `attention=`: a fused flash kernel (which generation: compute.ATTENTION_IMPL_SPEED), or
# "unfused" (two batched GEMMs around a softmax kernel, as Megatron ran it in 2021-22;
# "math" is the same thing by SDPA's name for it).
FLASH_ATTENTION = {"flash": None, "flash2": "flash2", "flash1": "flash1", "flash-triton": "flash-triton"}
ATTENTIONS = (*FLASH_ATTENTION, "unfused", "math")


def _divisors_for_tp(*sizes: int) -> tuple:
    return tuple(t for t in (1, 2, 4, 8, 16, 32, 64) if all(x % t == 0 for x in sizes if x))


def _gemm(name: str, m, n: int, k: int, *, tp_sharded: bool = True, linear: bool = True) -> OpSpec:
    # linear: an nn.Linear of its own weight (what float8 training converts)
    flops = 2 * m * n * k
    return OpSpec(name=name, kind="gemm", fwd_flops=flops, bwd_flops=2 * flops,
                  # forward reads input and weight, writes output; backward twice
                  fwd_bytes=BYTES * (m * k + k * n + m * n), bwd_bytes=2 * BYTES * (m * k + k * n + m * n),
                  gemm=(m, n, k), tp_sharded=tp_sharded, linear=linear)


def _elementwise(name: str, kind: str, reads, writes, *, tp_sharded: bool, count: int = 1, flops=0,
                 tp_replicated: bool = False) -> OpSpec:
    # backward reads the output gradient plus what the forward saved, writes input gradients
    return OpSpec(name=name, kind=kind, fwd_flops=flops, bwd_flops=2 * flops, fwd_bytes=reads + writes,
                  bwd_bytes=2 * reads + writes, tp_sharded=tp_sharded, tp_replicated=tp_replicated, count=count)


@dataclass(frozen=True)
class _Block:
    """One block's shape and how it is written (see `block`); the sizes in its own letters."""

    h: int  # hidden
    a: int  # heads
    g: int  # kv heads
    f: int  # ffn hidden
    gated_mlp: bool
    norm: str
    dropout: bool
    attention: str
    eager: bool
    fused_qkv: bool
    fused_qkv_split: bool

    @property
    def d(self) -> int:  # head dim
        return self.h // self.a

    @property
    def kv(self) -> int:
        return self.g * self.d

    @property
    def flash(self) -> bool:
        return self.attention in FLASH_ATTENTION

    @property
    def core_tp(self) -> bool:  # is the attention core (after the qkv GEMM) divided by tp?
        return not self.fused_qkv_split

    @property
    def core(self) -> dict:  # how the core's ops are marked: tp-sharded, or gathered (whole on every rank)
        return {"tp_sharded": self.core_tp, "tp_replicated": not self.core_tp}

    @property
    def core_saved(self):  # how the core's saved tensors are marked
        return True if self.core_tp else GATHERED

    @property
    def core_flops(self):
        return 4 * B * S * S * self.h  # QK^T + PV, unmasked

    @property
    def score_elems(self):
        return B * self.a * S * S

    def norm_op(self, name: str) -> OpSpec:
        # bytes per element a norm reads + writes: fused kernel 2 + 2; eager fp32 RMSNorm
        # (float(), pow, mean, mul by rsqrt, type_as, mul by weight) 36 over 7 kernels
        T, act, h = B * S, BYTES * B * S, self.h
        norm_rw, norm_count = ((18 * T * h, 18 * T * h), 7) if self.eager else ((act * h, act * h), 1)
        return _elementwise(name, "norm", *norm_rw, tp_sharded=False, count=norm_count)


def _attention_ops(k: _Block, rope: bool) -> list:
    """The attention half: norm, qkv projection(s), RoPE, the core, output projection, residual."""
    h, a, g, kv, core, eager = k.h, k.a, k.g, k.kv, k.core, k.eager
    T = B * S
    act = BYTES * T  # bytes of one 16-bit value per token
    ops = [k.norm_op("attn_norm")]
    if k.fused_qkv:
        ops.append(_gemm("qkv", T, h + 2 * kv, h))
    else:
        ops += [_gemm("wq", T, h, h), _gemm("wk", T, kv, h), _gemm("wv", T, kv, h)]
    if rope:
        if eager:  # q*cos, neg, cat, *sin, add: ~20 bytes per element over 5 kernels, for q and k
            ops.append(_elementwise("rope", "elementwise", 12 * T * (h + kv), 8 * T * (h + kv), **core,
                                    count=10))
        else:
            ops.append(_elementwise("rope", "elementwise", act * (h + kv), act * (h + kv), **core, count=2))
    if eager and g != a:  # repeat_kv materialises k and v at the full head count
        ops.append(_elementwise("repeat_kv", "elementwise", 2 * act * kv, 2 * act * h, **core, count=2))
    ops += _attention_core_ops(k)
    if eager:  # transpose(1, 2).reshape of the attention output copies it
        ops.append(_elementwise("attn_transpose", "elementwise", act * h, act * h, **core))
    ops.append(_gemm("attn_out", T, h, h))
    ops.append(_elementwise("attn_residual", "elementwise", 2 * act * h, act * h + (T * h if k.dropout else 0),
                            tp_sharded=False))
    return ops


def _attention_core_ops(k: _Block) -> list:
    h, kv, d, core, core_flops, score_elems = k.h, k.kv, k.d, k.core, k.core_flops, k.score_elems
    act = BYTES * B * S
    if k.flash:
        # backward 2.5x forward: FlopCounterMode's count (QK^T recomputed), as capture measures it
        return [OpSpec(name="attention", kind="attention", fwd_flops=core_flops, bwd_flops=5 * core_flops / 2,
                       fwd_bytes=act * (2 * h + 2 * kv), bwd_bytes=act * (4 * h + 4 * kv), **core,
                       causal=True, impl=FLASH_ATTENTION[k.attention])]
    # Megatron 2022: two batched GEMMs around a fused scale-mask-softmax kernel
    ops = [OpSpec(name="scores", kind="gemm", fwd_flops=core_flops / 2, bwd_flops=core_flops,
                  fwd_bytes=act * 2 * h + BYTES * score_elems, bwd_bytes=2 * (act * 2 * h + BYTES * score_elems),
                  gemm=(S, S, d, B * k.a), **core)]
    ops.append(_elementwise("softmax", "softmax", BYTES * score_elems, BYTES * score_elems, **core))
    if k.dropout:
        ops.append(_elementwise("attn_dropout", "elementwise", BYTES * score_elems,
                                BYTES * score_elems + score_elems, **core))
    ops.append(OpSpec(name="context", kind="gemm", fwd_flops=core_flops / 2, bwd_flops=core_flops,
                      fwd_bytes=BYTES * score_elems + act * 2 * h, bwd_bytes=2 * (BYTES * score_elems + act * 2 * h),
                      gemm=(S, d, S, B * k.a), **core))
    return ops


def _mlp_ops(k: _Block) -> list:
    """The MLP half: norm, the up projection(s) and activation, the down projection, residual."""
    h, f, eager = k.h, k.f, k.eager
    T = B * S
    act = BYTES * T
    ops = [k.norm_op("mlp_norm")]
    if k.gated_mlp:
        ops += [_gemm("w1", T, f, h), _gemm("w3", T, f, h)]
        if eager:  # silu (read, write) then multiply (read two, write)
            ops.append(_elementwise("swiglu", "elementwise", 3 * act * f, 2 * act * f, tp_sharded=True, count=2))
        else:
            ops.append(_elementwise("swiglu", "elementwise", 2 * act * f, act * f, tp_sharded=True))
    else:
        ops.append(_gemm("fc1", T, f, h))
        ops.append(_elementwise("gelu", "elementwise", act * f, act * f, tp_sharded=True))
    ops.append(_gemm("fc2", T, h, f))
    ops.append(_elementwise("mlp_residual", "elementwise", 2 * act * h, act * h + (T * h if k.dropout else 0),
                            tp_sharded=False))
    return ops


def _saved(k: _Block) -> list:
    """Saved activations: (bytes, divided by tp, dropped by selective checkpointing)."""
    h, a, g, f, kv, core_saved, score_elems = k.h, k.a, k.g, k.f, k.kv, k.core_saved, k.score_elems
    T = B * S
    act = BYTES * T
    saved = [
        (act * h, False, False),  # attention norm input
        (act * h, False, False),  # qkv GEMM input (norm output), replicated across tp
        (act * h, False, False),  # mlp norm input
        (act * h, False, False),  # fc1 / w1,w3 input (norm output)
        # attention output, input of the (row-parallel) attn_out GEMM. When the core ran
        # gathered, DTensor slices it locally for the GEMM, which saves that 1/tp slice; but
        # a flash kernel also saves its (whole) output for its own backward.
        (act * h, GATHERED if k.fused_qkv_split and k.flash else True, False),
    ]
    if k.eager and k.norm == "rmsnorm":  # eager fp32 RMSNorm keeps x.float() and the bf16 normalised x
        saved += [(2 * 4 * T * h, False, False)]
    if k.flash:
        kv_saved = h if (k.eager and g != a) else kv  # after repeat_kv, SDPA saves full-head k and v
        saved += [(act * (h + 2 * kv_saved), core_saved, False),  # q, k, v
                  (4 * B * a * S, core_saved, False)]  # fp32 log-sum-exp per row
    else:
        saved += [(act * (h + kv), core_saved, False),  # q, k for QK^T
                  (act * kv, core_saved, False),  # v for PV
                  (BYTES * score_elems, core_saved, True)]  # softmax output
        if k.dropout:
            saved += [(score_elems, core_saved, True), (BYTES * score_elems, core_saved, True)]  # mask, dropped probs
    if k.gated_mlp:
        saved += [(3 * act * f, True, False),  # w1 out, silu out, w3 out
                  (act * f, True, False)]  # w2 input
    else:
        saved += [(act * f, True, False), (act * f, True, False)]  # gelu input, fc2 input
    if k.dropout:
        saved += [(T * h, False, False), (T * h, False, False)]  # two residual dropout masks
    return saved


def _selective(k: _Block, saved: list, sac: str) -> tuple:
    """(bytes selective checkpointing drops, FLOPs it redoes, of them tp-sharded, of them gathered)."""
    h, f, kv = k.h, k.f, k.kv
    T = B * S
    act = BYTES * T
    selective = sum(x for x, _, sel in saved if sel)
    # Default (None): all of `selective` counts as tp-sharded, as before; a gathered core is not.
    selective_sharded = None if k.core_tp else sum(x for x, tp, sel in saved if sel and tp is True)
    selective_gathered = sum(x for x, tp, sel in saved if sel and tp == GATHERED)
    selective_flops = k.core_flops
    if k.flash:
        # FlashAttention stores no s^2 scores, so Korthikanti's selective checkpointing has
        # nothing to drop. Selective then means an op-level policy (autopar's lowering,
        # autopar/lower/checkpointing.py: keep matmul and attention outputs, recompute the
        # cheap ops): it drops the two norm outputs and the activation-function outputs
        # (SiLU and the product for SwiGLU, GELU's output), and redoes only cheap ops.
        selective = 2 * act * h + (2 if k.gated_mlp else 1) * act * f
        selective_flops = 0
        if sac == "torchtitan":
            # torchtitan's policy also recomputes every other matmul (wk, wo, w3 in a
            # Llama block) and so drops their outputs too.
            selective += act * f
            selective_flops = 2 * T * h * (kv + h + f)
        if not k.core_tp:  # the norm outputs are replicated; the MLP activations are tp-sharded
            selective_sharded, selective_gathered = selective - 2 * act * h, 0
    return selective, selective_flops, selective_sharded, selective_gathered


def block(index: int, *, hidden: int, heads: int, ffn_hidden: int, kv_heads: int | None = None, gated_mlp: bool = False,
          norm: str = "layernorm", dropout: bool = False, attention: str = "flash", bias: bool = True,
          fused_qkv: bool = True, rope: bool = False, eager: bool = False, sac: str = "autopar",
          fused_qkv_split: bool = False, name: str | None = None) -> LayerSpec:
    """One transformer block as a LayerSpec (expressions in B and S).

    eager=True prices the reference PyTorch code as written (examples/llama.py,
    torchtitan without torch.compile): RMSNorm in fp32 over ~7 kernels,
    rotate-half RoPE, repeat_kv copies, separate SiLU and multiply. Each eager
    kernel reads and writes whole tensors, which is what makes eager slower.

    fused_qkv_split=True: the attention core runs replicated on every tp rank
    after an all-gather of the fused qkv output (see the module docstring).
    """
    if attention not in ATTENTIONS:
        raise CostModelError(f"attention={attention!r}: expected one of {', '.join(ATTENTIONS)}")
    if fused_qkv_split and not fused_qkv:
        raise CostModelError("fused_qkv_split=True needs fused_qkv=True: separate wq/wk/wv projections "
                             "stay head-parallel, leave fused_qkv_split off")
    k = _Block(hidden, heads, kv_heads or heads, ffn_hidden, gated_mlp, norm, dropout, attention, eager, fused_qkv,
               fused_qkv_split)
    h, a, g, f, d, kv = k.h, k.a, k.g, k.f, k.d, k.kv
    act = BYTES * B * S  # bytes of one 16-bit value per token
    ops = _attention_ops(k, rope) + _mlp_ops(k)
    saved = _saved(k)
    selective, selective_flops, selective_sharded, selective_gathered = _selective(k, saved, sac)
    norm_params = 2 * h if norm == "layernorm" else h
    params = (h * (h + 2 * kv) + h * h + (2 if gated_mlp else 1) * h * f + f * h + 2 * norm_params
              + ((h + 2 * kv) + h + f + h if bias else 0))
    sig = (f"transformer_block:h{h}:a{a}:g{g}:f{f}:gated{int(gated_mlp)}:{norm}:drop{int(dropout)}:"
           f"{attention}:bias{int(bias)}:fusedqkv{int(fused_qkv)}:rope{int(rope)}:eager{int(eager)}:sac-{sac}"
           + (":qkv-split" if fused_qkv_split else ""))
    return LayerSpec(
        name=name or f"blocks.{index}",
        kind="transformer_block",
        params=params,
        param_bytes=BYTES * params,
        fwd_flops=sum(op.fwd_flops for op in ops),
        bwd_flops=sum(op.bwd_flops for op in ops),
        activation_bytes=sum(x for x, _, _ in saved),
        output_bytes=act * h,
        input_bytes=act * h,
        activation_bytes_tp_sharded=sum(x for x, tp, _ in saved if tp is True),
        activation_bytes_selective=selective,
        selective_recompute_flops=selective_flops,
        activation_bytes_selective_tp_sharded=selective_sharded,
        activation_bytes_tp_gathered=sum(x for x, tp, _ in saved if tp == GATHERED),
        activation_bytes_selective_tp_gathered=selective_gathered,
        tp_allreduces=2,
        tp_gather_bytes=0 if k.core_tp else act * (h + 2 * kv),  # the fused qkv output
        tp_degrees=_divisors_for_tp(a, g, f),
        ops=ops,
        attrs={"hidden": h, "heads": a, "kv_heads": g, "head_dim": d, "ffn_hidden": f, "causal": True,
               "param_tensors": _block_tensors(fused_qkv, gated_mlp, bias, norm)},
        signature=sig,
        module_paths=[name or f"blocks.{index}"],
    )


def _block_tensors(fused_qkv: bool, gated_mlp: bool, bias: bool, norm: str) -> int:
    """Parameter tensors of a block (the optimizer pays per tensor as well as per element)."""
    gemms = (1 if fused_qkv else 3) + 1 + (3 if gated_mlp else 2)
    return gemms * (2 if bias else 1) + 2 * (2 if norm == "layernorm" else 1)


def embedding(*, hidden: int, vocab_size: int, seq_len: int, learned_positions: bool, dropout: bool,
              norm: bool = False) -> LayerSpec:
    h, v = hidden, vocab_size
    T = B * S
    act = BYTES * T
    params = v * h + (seq_len * h if learned_positions else 0) + (2 * h if norm else 0)
    ops = [OpSpec(name="lookup", kind="embedding", fwd_bytes=2 * act * h + 8 * T,
                  # backward scatters into a dense vocab-sized gradient: zero it, then add T rows
                  bwd_bytes=BYTES * v * h + 2 * act * h, tp_sharded=True, count=2)]
    if learned_positions or dropout:
        ops.append(_elementwise("pos_add_dropout", "elementwise", 2 * act * h, act * h, tp_sharded=False))
    if norm:
        ops.append(_elementwise("embed_norm", "norm", act * h, act * h, tp_sharded=False))
    saved = (T * h if dropout else 0) + (act * h if norm else 0)
    return LayerSpec(
        name="embedding", kind="embedding", params=params, param_bytes=BYTES * params,
        fwd_flops=0, bwd_flops=0, activation_bytes=saved, output_bytes=act * h, input_bytes=8 * T,
        activation_bytes_tp_sharded=0, tp_allreduces=1, tp_degrees=_divisors_for_tp(v) or (1,),
        ops=ops, attrs={"hidden": h, "vocab_size": v,
                        "param_tensors": 1 + int(learned_positions) + (2 if norm else 0)},
        signature=f"embedding:v{v}:h{h}",
        module_paths=["wte", "wpe"] if learned_positions else ["tok_embeddings"],
    )


def head(*, hidden: int, vocab_size: int, tied: bool, norm: str = "layernorm") -> LayerSpec:
    h, v = hidden, vocab_size
    T = B * S
    act = BYTES * T
    norm_params = 2 * h if norm == "layernorm" else h
    ops = [
        _elementwise("final_norm", "norm", act * h, act * h, tp_sharded=False),
        _gemm("lm_head", T, v, h, linear=not tied),
        # cross-entropy over fp32 logits: read bf16 logits, write the fp32 softmax it saves
        OpSpec(name="cross_entropy", kind="softmax", fwd_flops=5 * T * v, bwd_flops=2 * T * v,
               fwd_bytes=6 * T * v, bwd_bytes=6 * T * v, tp_sharded=True, count=3),
    ]
    params = norm_params + (0 if tied else v * h)
    saved_replicated = 2 * act * h  # final norm input, lm_head input
    saved_sharded = 4 * T * v  # fp32 softmax of the logits (Korthikanti: 4 s b v / t)
    return LayerSpec(
        name="head", kind="head", params=params, param_bytes=BYTES * params,
        fwd_flops=sum(op.fwd_flops for op in ops if op.kind == "gemm"),
        bwd_flops=sum(op.bwd_flops for op in ops if op.kind == "gemm"),
        activation_bytes=saved_replicated + saved_sharded, output_bytes=4 * B, input_bytes=act * h,
        activation_bytes_tp_sharded=saved_sharded, tp_allreduces=1, tp_degrees=_divisors_for_tp(v) or (1,),
        ops=ops, attrs={"hidden": h, "vocab_size": v, "tied_param_count": v * h if tied else 0,
                        "param_tensors": (2 if norm == "layernorm" else 1) + (0 if tied else 1)},
        signature=f"head:v{v}:h{h}:tied{int(tied)}",
        module_paths=["ln_f", "lm_head"], shared_params=["wte.weight"] if tied else [],
    )


def transformer(name: str, *, hidden: int, heads: int, layers: int, seq_len: int, vocab_size: int,
                kv_heads: int | None = None, ffn_hidden: int | None = None, gated_mlp: bool = False,
                tied: bool = True, learned_positions: bool = True, norm: str = "layernorm", dropout: bool = False,
                attention: str = "flash", bias: bool = True, fused_qkv: bool = True, rope: bool = False,
                embedding_norm: bool = False, eager: bool = False, sac: str = "autopar",
                fused_qkv_split: bool = False) -> ModelSpec:
    """A decoder-only transformer workload from its shape."""
    ffn = ffn_hidden or 4 * hidden
    blocks = [block(i, hidden=hidden, heads=heads, ffn_hidden=ffn, kv_heads=kv_heads, gated_mlp=gated_mlp, norm=norm,
                    dropout=dropout, attention=attention, bias=bias, fused_qkv=fused_qkv, rope=rope, eager=eager,
                    sac=sac, fused_qkv_split=fused_qkv_split)
              for i in range(layers)]
    layers_ = ([embedding(hidden=hidden, vocab_size=vocab_size, seq_len=seq_len, learned_positions=learned_positions,
                          dropout=dropout, norm=embedding_norm)]
               + blocks + [head(hidden=hidden, vocab_size=vocab_size, tied=tied, norm=norm)])
    return ModelSpec(name=name, layers=layers_, seq_len=seq_len, dtype_bytes=BYTES, tokens_per_sample=seq_len)


def gpt(name: str, *, hidden: int, heads: int, layers: int, seq_len: int, vocab_size: int, dropout: bool = False,
        attention: str = "flash", **kw) -> ModelSpec:
    """GPT-2/3 style: LayerNorm, GELU MLP of 4h, biases, learned positions, tied head.
    Head-parallel TP by default (Megatron); fused_qkv_split=True for examples/gpt.py's layout."""
    return transformer(name, hidden=hidden, heads=heads, layers=layers, seq_len=seq_len, vocab_size=vocab_size,
                       dropout=dropout, attention=attention, **kw)


def llama(name: str, *, hidden: int, heads: int, layers: int, seq_len: int, vocab_size: int, kv_heads: int,
          ffn_hidden: int, **kw) -> ModelSpec:
    """Llama style: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied head."""
    kw = {"tied": False, "learned_positions": False, "norm": "rmsnorm", "bias": False, "fused_qkv": False,
          "rope": True, "gated_mlp": True, **kw}
    return transformer(name, hidden=hidden, heads=heads, layers=layers, seq_len=seq_len, vocab_size=vocab_size,
                       kv_heads=kv_heads, ffn_hidden=ffn_hidden, **kw)


def model_flops_per_step(model: ModelSpec, global_batch_size: int) -> float:
    """Model FLOPs for one optimizer step: 3 x forward (PaLM / Megatron / torchtitan
    convention: backward = 2 x forward, attention unmasked, no recomputation)."""
    return 3 * sum(layer.eval("fwd_flops", 1, model.seq_len) for layer in model.layers) * global_batch_size
