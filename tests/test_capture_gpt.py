"""Capture of GPT against the published analytic counts (Korthikanti et al.
2022, "Reducing Activation Recomputation in Large Transformer Models";
Narayanan et al. 2021, Megatron eq. 2)."""
import math

import pytest
import torch
import torch.nn.functional as F

import autopar
import gpt
from cost_models.workload import B, S, evaluate


def _capture(cfg, **kwargs):
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    return model, autopar.capture(model, lambda b: gpt.example_inputs(b, cfg), **kwargs)


class _MegatronLayoutAttention(gpt.CausalSelfAttention):
    """Megatron's head-parallel layout of the same fused qkv: view the projection
    as (b, s, heads, 3 * head_dim) first, then split head_dim. The split no longer
    cuts the tensor-parallel (head) dim, so the attention core stays sharded."""

    def forward(self, x):
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(x).view(b, s, self.heads, 3 * d).split(d, dim=3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.attention_impl == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            scores = scores.masked_fill(self.future[:s, :s], float("-inf"))
            y = self.attn_drop(F.softmax(scores, dim=-1)) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, s, h))


def _megatron_layout(cfg):
    with torch.device("meta"):
        model = gpt.GPT(cfg)
        for block in model.blocks:
            block.attn = _MegatronLayoutAttention(cfg)
    return model


MATH_CFG = gpt.GPTConfig(vocab_size=1000, seq_len=256, hidden=256, layers=2, heads=8, dropout=0.1,
                         attention_impl="math")


@pytest.fixture(scope="module")
def math_gpt():
    return MATH_CFG, _capture(MATH_CFG)[1]


@pytest.fixture(scope="module")
def megatron_gpt():
    return MATH_CFG, autopar.capture(_megatron_layout(MATH_CFG), lambda b: gpt.example_inputs(b, MATH_CFG))


@pytest.fixture(scope="module")
def sdpa_gpt():
    cfg = gpt.GPTConfig(vocab_size=1000, seq_len=256, hidden=256, layers=2, heads=8, dropout=0.1)
    return cfg, _capture(cfg)[1]


@pytest.mark.parametrize("b,s", [(1, 256), (4, 128), (8, 64)])
def test_megatron_head_parallel_layout_matches_korthikanti_tp_split(megatron_gpt, b, s):
    cfg, graph = megatron_gpt
    h, a = cfg.hidden, cfg.heads
    block = graph.layers[1]
    assert evaluate(block.activation_bytes, b, s) == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=0.05)
    # Megatron's tensor-parallel split: 24sbh + 5as^2b of the 34sbh + 5as^2b are divided by t.
    assert evaluate(block.activation_bytes_tp_sharded, b, s) == pytest.approx(24 * s * b * h + 5 * a * s * s * b,
                                                                             rel=0.01)
    assert block.tp_gather_bytes == 0
    assert evaluate(block.activation_bytes_selective_tp_sharded, b, s) == evaluate(
        block.activation_bytes_selective, b, s)
    assert all(op.tp_sharded for op in block.ops if op.kind in ("attention", "softmax"))


@pytest.mark.parametrize("b,s", [(1, 256), (4, 128), (8, 64)])
def test_activation_bytes_match_korthikanti_with_math_attention(math_gpt, b, s):
    cfg, graph = math_gpt
    h, a = cfg.hidden, cfg.heads
    block = graph.layers[1]
    expected = s * b * h * (34 + 5 * a * s / h)  # bytes, bf16 activations and 1-byte dropout masks
    assert evaluate(block.activation_bytes, b, s) == pytest.approx(expected, rel=0.05)
    # The attention core (QK^T, softmax, dropout mask and output): what selective recomputation drops.
    assert evaluate(block.activation_bytes_selective, b, s) == pytest.approx(5 * a * s * s * b, rel=0.01)
    # GPT's fused qkv split cuts the sharded dim: q, k, v are all-gathered (3h values
    # per token, bf16) and the attention core with its scores is kept whole on every
    # rank; only the MLP's 16sbh and the out-projection's input (2sbh, sliced locally
    # for the row-parallel GEMM) are divided by t.
    assert evaluate(block.tp_gather_bytes, b, s) == 3 * s * b * h * 2
    assert evaluate(block.activation_bytes_tp_sharded, b, s) == pytest.approx(18 * s * b * h, rel=0.01)
    assert evaluate(block.activation_bytes_tp_gathered, b, s) == pytest.approx(6 * s * b * h + 5 * a * s * s * b,
                                                                              rel=0.01)
    assert evaluate(block.activation_bytes_selective_tp_sharded, b, s) == 0
    # Recomputing the attention core redoes QK^T and scores x V: 4 b s^2 h FLOPs.
    assert evaluate(block.selective_recompute_flops, b, s) == pytest.approx(4 * b * s * s * h, rel=0.01)


def test_flash_attention_keeps_no_s_squared_term(sdpa_gpt):
    cfg, graph = sdpa_gpt
    block = graph.layers[1]
    expr = block.activation_bytes
    assert expr.as_poly(B, S).degree(S) == 1  # flash keeps q, k, v, out and the logsumexp only
    b, s, h = 2, 256, cfg.hidden
    # No s^2 core to drop: selective means the op-level policy lowering runs
    # (autopar/checkpoint_policy.py: keep matmul and attention outputs, redo the
    # rest). Per token it drops the two LayerNorm outputs (2 x 2h bytes) and their
    # fp32 mean/rstd (2 x 8), the GELU output (2 x 4h), the contiguous copy of the
    # attention output that feeds the projection (2h) and the two 1-byte residual
    # dropout masks (2h): 16h + 16 bytes. But torch's selective checkpointing stores
    # the output of every must-save op, also where autograd keeps none: the two output
    # projections' (attention c_proj, MLP c_proj: 2 x 2h), so it drops 12h + 16.
    assert evaluate(block.activation_bytes_selective, b, s) == b * s * (12 * h + 16)
    assert evaluate(expr, b, s) == pytest.approx(s * b * h * 34, rel=0.10)


@pytest.mark.parametrize("fixture", ["math_gpt", "sdpa_gpt"])
def test_block_flops_match_korthikanti(fixture, request):
    cfg, graph = request.getfixturevalue(fixture)
    h = cfg.hidden
    for b, s in [(1, 256), (3, 200), (16, 2048)]:
        block = graph.layers[1]
        fwd = 24 * b * s * h * h * (1 + s / (6 * h))
        assert evaluate(block.fwd_flops, b, s) == pytest.approx(fwd, rel=0.02)
        if fixture == "math_gpt":
            # training = 3x forward: backward does the dX and dW GEMMs (2x forward)
            assert evaluate(block.fwd_flops + block.bwd_flops, b, s) == pytest.approx(3 * fwd, rel=0.02)
        else:
            # flash backward recomputes the scores: 2.5x its forward (FlopCounterMode's count)
            attn = next(op for op in block.ops if op.kind == "attention")
            assert evaluate(attn.bwd_flops, b, s) == 2.5 * evaluate(attn.fwd_flops, b, s)
            assert evaluate(block.bwd_flops - attn.bwd_flops, b, s) == 2 * evaluate(block.fwd_flops - attn.fwd_flops, b, s)


@pytest.mark.parametrize("preset", ["gpt_tiny", "gpt2_small", "gpt3_1_3b", "gpt3_175b"])
def test_total_params_match_megatron_eq2_and_numel(preset):
    cfg = gpt.PRESETS[preset]
    model, graph = _capture(cfg)
    l, h, V, s = cfg.layers, cfg.hidden, cfg.vocab_size, cfg.seq_len
    # Megatron eq. 2 (tied embeddings, biases, learned positions) + the final LayerNorm (2h).
    megatron = 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))
    assert graph.total_params == round(megatron) + 2 * h
    assert graph.total_params == sum(p.numel() for p in model.parameters())


def test_params_equal_real_instantiation_and_tied_weight_is_shared():
    cfg = gpt.PRESETS["gpt_tiny"]
    model = gpt.GPT(cfg)  # real weights, on CPU
    graph = autopar.capture(model, lambda b: gpt.example_inputs(b, cfg))
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    names = [layer.name for layer in graph.layers]
    assert names == ["embedding", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    embedding, head = graph.layers[0], graph.layers[-1]
    assert embedding.module_paths == ["wte", "wpe", "drop"]
    assert head.module_paths == ["ln_f", "lm_head"]
    assert head.shared_params == ["wte.weight"]  # counted once, at the embedding
    assert embedding.params == (cfg.vocab_size + cfg.seq_len) * cfg.hidden
    assert head.params == 2 * cfg.hidden
    assert head.param_bytes == 2 * head.params  # bf16
    assert next(model.parameters()).device.type == "cpu"  # the caller's model is untouched


def test_symbolic_costs_equal_a_capture_at_another_size():
    base = gpt.GPTConfig(vocab_size=512, seq_len=64, hidden=64, layers=2, heads=4, dropout=0.1,
                         attention_impl="math")
    short = gpt.GPTConfig(**{**base.__dict__, "seq_len": 24})
    _, g64 = _capture(base)
    _, g24 = _capture(short)
    for layer64, layer24 in zip(g64.layers[1:-1], g24.layers[1:-1]):
        for field in ("fwd_flops", "bwd_flops", "activation_bytes", "activation_bytes_selective",
                      "activation_bytes_tp_sharded", "output_bytes"):
            assert evaluate(getattr(layer64, field), 5, 24) == evaluate(getattr(layer24, field), 5, 24), field


def test_identical_blocks_share_a_signature_and_attrs(sdpa_gpt):
    cfg, graph = sdpa_gpt
    blocks = [layer for layer in graph.layers if layer.kind == "transformer_block"]
    assert len(blocks) == cfg.layers and len({b.signature for b in blocks}) == 1
    assert graph.layers[0].signature != blocks[0].signature
    attrs = blocks[0].attrs
    assert attrs["hidden"] == cfg.hidden and attrs["heads"] == cfg.heads
    assert attrs["head_dim"] == cfg.hidden // cfg.heads and attrs["kv_heads"] == cfg.heads
    assert attrs["ffn_hidden"] == 4 * cfg.hidden and attrs["seq_len"] == cfg.seq_len
    assert blocks[0].tp_allreduces == 2 and graph.layers[0].tp_allreduces == 1
    assert set(blocks[0].tp_degrees) == {1, 2, 4, 8}  # divisors of gcd(heads, kv_heads, ffn)
    assert graph.layers[-1].attrs["vocab_size"] == cfg.vocab_size
    assert 8 in graph.layers[0].tp_degrees and 16 not in graph.layers[0].tp_degrees  # 1000 = 8 * 125


def test_odd_vocabulary_keeps_embedding_and_head_replicated():
    cfg = gpt.PRESETS["gpt2_small"]  # vocab 50257 = 29 * 1733
    graph = _capture(cfg)[1]
    assert graph.layers[0].tp_degrees == (1, 29)  # no power of two divides it
    assert graph.layers[-1].tp_degrees == graph.layers[0].tp_degrees


def test_ops_are_gemms_with_shapes_and_tp_flags(sdpa_gpt):
    cfg, graph = sdpa_gpt
    h = cfg.hidden
    ops = {op.name: op for op in graph.layers[1].ops}
    qkv, fc2 = ops["attn.qkv:addmm"], ops["mlp.proj:addmm"]
    assert qkv.kind == "gemm" and qkv.tp_sharded and fc2.tp_sharded
    assert [evaluate(x, 2, 100) for x in qkv.gemm] == [200, 3 * h, h]
    assert [evaluate(x, 2, 100) for x in fc2.gemm] == [200, h, 4 * h]
    assert not ops["ln_1:native_layer_norm"].tp_sharded
    assert evaluate(qkv.bwd_flops, 2, 100) == 2 * evaluate(qkv.fwd_flops, 2, 100)
    layer = graph.layers[1]
    assert sum(evaluate(op.fwd_flops, 2, 100) for op in layer.ops) == evaluate(layer.fwd_flops, 2, 100)
    assert sum(evaluate(op.bwd_flops, 2, 100) for op in layer.ops) == evaluate(layer.bwd_flops, 2, 100)
