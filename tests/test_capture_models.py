"""Capture on every zoo model (tiny presets, real weights) and on the model
features people use: tied weights, buffers, kwargs inputs,
nn.MultiheadAttention, scaled_dot_product_attention, top-k MoE routing."""
import math

import pytest
import torch
import torch.nn as nn

import autopar
import gpt
import llama
import moe
import resnet
import vit
from cost_models.workload import B, S, evaluate

ZOO = {
    "gpt_tiny": (gpt.gpt_tiny, ["embedding"] + ["transformer_block"] * 4 + ["head"]),
    "llama_tiny": (llama.llama_tiny, ["embedding"] + ["transformer_block"] * 4 + ["head"]),
    "vit_tiny": (vit.vit_tiny, ["embedding"] + ["transformer_block"] * 3 + ["head"]),
    "resnet_tiny": (resnet.resnet_tiny, ["conv_stage"] * 6 + ["head"]),
    "moe_tiny": (moe.moe_tiny, ["embedding"] + ["moe_block"] * 2 + ["head"]),
}


@pytest.fixture(scope="module")
def captured():
    out = {}
    for name, (factory, _) in ZOO.items():
        torch.manual_seed(0)
        model, inputs = factory()  # real weights on CPU: the params must match them exactly
        out[name] = (model, inputs, autopar.capture(model, inputs, name=name))
    return out


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_captures_with_exact_params_and_kinds(captured, name):
    model, _, graph = captured[name]
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    assert [layer.kind for layer in graph.layers] == ZOO[name][1]
    for layer in graph.layers:
        assert layer.params >= 0 and layer.param_bytes == 2 * layer.params
        for field in ("fwd_flops", "bwd_flops", "activation_bytes", "output_bytes", "input_bytes"):
            value = evaluate(getattr(layer, field), 2, graph.seq_len)
            assert value >= 0, (layer.name, field)
        assert layer.module_paths and layer.signature
    blocks = [layer for layer in graph.layers if layer.kind in ("transformer_block", "moe_block")]
    assert len({b.signature for b in blocks}) <= 1
    assert graph.graph.number_of_nodes() > len(graph.layers)


def test_models_without_sequence_axis_have_batch_only_costs(captured):
    for name in ("vit_tiny", "resnet_tiny"):
        graph = captured[name][2]
        assert graph.seq_len is None
        for layer in graph.layers:
            for field in ("fwd_flops", "activation_bytes"):
                expr = getattr(layer, field)
                assert S not in getattr(expr, "free_symbols", set()), (name, layer.name)
    graph = captured["vit_tiny"][2]
    assert graph.layers[0].params == sum(p.numel() for n, p in captured["vit_tiny"][0].named_parameters()
                                         if n.startswith(("conv_proj", "class_token", "pos_embedding")))


def test_resnet_stages_follow_module_tree(captured):
    graph = captured["resnet_tiny"][2]
    assert [layer.name for layer in graph.layers] == ["stem", "layer1.0", "layer2.0", "layer2.1", "layer3.0",
                                                      "layer4.0", "head"]
    assert graph.layers[0].module_paths == ["conv1", "bn1", "relu", "maxpool"]
    assert graph.layers[-1].module_paths == ["avgpool", "fc"]
    # A downsampling block and a plain block of the same stage differ.
    assert graph.layers[2].signature != graph.layers[3].signature


def test_llama_grouped_query_attention_attrs(captured):
    cfg = llama.PRESETS["llama_tiny"]
    block = captured["llama_tiny"][2].layers[1]
    assert block.attrs["heads"] == cfg.heads and block.attrs["kv_heads"] == cfg.kv_heads
    assert block.attrs["ffn_hidden"] == cfg.ffn_hidden and block.attrs["hidden"] == cfg.dim
    assert set(block.tp_degrees) == {1, 2}  # kv_heads=2 bounds tensor parallelism
    ops = {op.name for op in block.ops}
    assert {"attention.wq:mm", "attention.wk:mm", "feed_forward.w1:mm", "feed_forward.w2:mm"} <= ops


def test_moe_capture_assumes_balanced_top_k_routing(captured):
    cfg = moe.PRESETS["moe_tiny"]
    block = captured["moe_tiny"][2].layers[1]
    assert block.attrs["experts"] == cfg.experts and block.attrs["top_k"] == cfg.top_k
    d, f, e, k = cfg.dim, cfg.ffn_hidden, cfg.experts, cfg.top_k
    b, s = 3, 16
    tokens = b * s
    expected = (2 * tokens * d * 3 * d + 2 * tokens * d * d  # wqkv, wo
                + 4 * b * s * s * d  # attention scores and values (unmasked count)
                + 2 * tokens * d * e  # router
                + 3 * 2 * d * f * tokens * k)  # experts: each token visits k of them
    assert evaluate(block.fwd_flops, b, s) == expected
    assert block.tp_allreduces == 2  # attention out-projection + the experts' combined w2


class WithBuffersAndKwargs(nn.Module):
    """MultiheadAttention with need_weights=True (explicit softmax), a buffer,
    and a keyword-only mask input."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 4, batch_first=True)
        self.ln = nn.LayerNorm(16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x, mask=None):
        y, _ = self.mha(x, x, x, need_weights=True, attn_mask=mask)
        return self.ln(x + y) * self.scale


class KwargsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList([WithBuffersAndKwargs(), WithBuffersAndKwargs()])
        self.out = nn.Linear(16, 50)

    def forward(self, tokens, *, mask=None):
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.out(x)


def _kwargs_inputs(batch_size):
    return (torch.randint(0, 50, (batch_size, 12)), {"mask": torch.ones(12, 12, dtype=torch.bool).triu(1)})


def test_kwargs_buffers_and_multihead_attention_with_weights():
    model = KwargsModel()
    graph = autopar.capture(model, _kwargs_inputs)
    assert graph.total_params == sum(p.numel() for p in model.parameters())
    assert graph.seq_len == 12 and not graph.notes  # the (s, s) mask follows the sequence length
    block = graph.layers[1]
    assert block.kind == "transformer_block" and block.attrs["heads"] == 4
    # need_weights=True materialises the (b, heads, s, s) softmax: saved for backward, selective drops it.
    assert block.activation_bytes_selective == 2 * 4 * B * S ** 2
    assert sum(b.numel() for b in model.buffers()) == 32  # buffers are state, not parameters or activations


class SDPABlock(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, d))


def test_float_sequence_inputs_and_sdpa_blocks():
    model = nn.Sequential(SDPABlock(), SDPABlock(), SDPABlock())
    graph = autopar.capture(model, (torch.randn(2, 64, 32),))  # (batch, seq, hidden) floats
    assert graph.seq_len == 64
    assert [layer.name for layer in graph.layers] == ["0", "1", "2"]
    block = graph.layers[0]
    d, b, s = 32, 2, 64
    assert evaluate(block.fwd_flops, b, s) == 2 * b * s * d * 4 * d + 4 * b * s * s * d
    assert block.activation_bytes.as_poly(B, S).degree(S) == 1  # flash: no s^2 saved


def test_capture_dtype_sets_bytes():
    model, inputs = gpt.gpt_tiny()
    g16 = autopar.capture(model, inputs)
    g32 = autopar.capture(model, inputs, dtype=torch.float32)
    assert g32.dtype_bytes == 4 and g16.dtype_bytes == 2
    assert g32.layers[1].param_bytes == 2 * g16.layers[1].param_bytes
    b, s = 2, 16
    ratio = evaluate(g32.layers[1].activation_bytes, b, s) / evaluate(g16.layers[1].activation_bytes, b, s)
    assert 1.7 < ratio <= 2.0  # layer-norm statistics are fp32 in both
    assert math.isclose(evaluate(g32.layers[1].fwd_flops, b, s), evaluate(g16.layers[1].fwd_flops, b, s))


def test_loss_fn_joins_the_head_layer():
    model, inputs = gpt.gpt_tiny()
    cfg = gpt.PRESETS["gpt_tiny"]
    plain = autopar.capture(model, inputs)
    with_loss = autopar.capture(model, inputs, loss_fn=gpt.loss_fn)
    assert [layer.name for layer in with_loss.layers] == [layer.name for layer in plain.layers]
    head, head0 = with_loss.layers[-1], plain.layers[-1]
    assert head.attrs["loss"] is True and "loss" not in head0.attrs
    extra = evaluate(head.activation_bytes - head0.activation_bytes, 4, 16)
    # cross_entropy keeps the bf16 log-softmax of the logits (2 bytes * vocab per token), the int64
    # targets (8 bytes per token) and a scalar
    assert extra == 2 * cfg.vocab_size * 4 * 16 + 8 * 4 * 16 + 2
    assert evaluate(head.output_bytes, 4, 16) == 2  # a bf16 scalar leaves the head
    assert any(op.name == "loss:_log_softmax" and op.tp_sharded for op in head.ops)


class FixedPositions(nn.Module):
    """A learned position table added whole: runs only at its own length."""

    def __init__(self, s=16, d=16):
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.pos = nn.Parameter(torch.zeros(1, s, d))
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(2)])

    def forward(self, tokens):
        x = self.emb(tokens) + self.pos
        for block in self.blocks:
            x = block(x)
        return x


def test_model_fixed_to_its_sequence_length_falls_back_to_batch_only():
    graph = autopar.capture(FixedPositions(), lambda b: (torch.randint(0, 32, (b, 16)),))
    assert graph.seq_len == 16 and graph.notes and "sequence length fixed at 16" in graph.notes[0]
    assert graph.seq_fit == "none"
    block = graph.layers[1]
    assert S not in block.fwd_flops.free_symbols
    assert evaluate(block.fwd_flops, 3, 16) == 2 * 3 * 16 * 16 * 16


class Windowed(nn.Module):
    def __init__(self, window, layer_idx):
        super().__init__()
        self.window = window  # a per-layer config value: blocks are not interchangeable
        self.layer_idx = layer_idx  # the block's position (HF keeps it for the KV cache): says nothing
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)[..., : self.window]
        return torch.nn.functional.pad(y, (0, 8 - self.window))


def test_blocks_with_different_config_attributes_are_measured_separately():
    model = nn.Sequential(Windowed(8, 0), Windowed(4, 1), Windowed(4, 2))
    graph = autopar.capture(model, (torch.randn(2, 8),))
    sigs = [layer.signature for layer in graph.layers]
    assert sigs[0] != sigs[1] and sigs[1] == sigs[2]


def test_layer_index_alone_does_not_make_blocks_differ():
    from autopar.capture.module_tree import static_signature

    assert static_signature(Windowed(4, 1)) == static_signature(Windowed(4, 7))
    assert static_signature(Windowed(4, 1)) != static_signature(Windowed(2, 1))


def test_multihead_attention_runs_as_non_causal_flash(captured):
    block = captured["vit_tiny"][2].layers[1]
    attention = [op for op in block.ops if op.kind == "attention"]
    assert len(attention) == 1 and attention[0].causal is False
    assert block.attrs["causal"] is False
    assert captured["gpt_tiny"][2].layers[1].attrs["causal"] is True
    import torch.nn.functional as F
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention  # restored after capture


def test_model_built_under_fake_tensor_mode_and_seq_dim_none():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model, inputs = gpt.gpt_tiny()
    graph = autopar.capture(model, inputs, seq_dim=None)
    assert graph.total_params == 55488
    assert graph.seq_len is None  # costs fitted in batch only, at the inputs' length
    assert S not in graph.layers[1].fwd_flops.free_symbols
    real = autopar.capture(*gpt.gpt_tiny())
    assert evaluate(graph.layers[1].fwd_flops, 3) == evaluate(real.layers[1].fwd_flops, 3, 16)


class TitanBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.attn_norm, self.wq = nn.RMSNorm(d), nn.Linear(d, d, bias=False)
        self.w1, self.w2 = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        x = x + self.wq(self.attn_norm(x))
        return x + self.w2(torch.nn.functional.silu(self.w1(x)))


class TitanStyle(nn.Module):
    """torchtitan keeps its blocks in an nn.ModuleDict keyed by layer id."""

    def __init__(self, n=3, d=32, vocab=64):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleDict({str(i): TitanBlock(d) for i in range(n)})
        self.norm, self.output = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def test_blocks_in_a_module_dict_are_layers():
    graph = autopar.capture(TitanStyle(), lambda b: (torch.randint(0, 64, (b, 16)),))
    assert [l.name for l in graph.layers] == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "head"]
    assert graph.layers[-1].module_paths == ["norm", "output"]
    assert len({l.signature for l in graph.layers[1:4]}) == 1


class EagerRMSNorm(nn.Module):
    """RMSNorm as Hugging Face writes it: several eager ops where an engine's kernel is one."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


class NormBlock(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm, self.proj = EagerRMSNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.proj(self.norm(x))


def test_a_chain_of_memory_bound_ops_knows_what_one_kernel_would_save():
    """An engine that runs each chain of memory-bound ops in a module as one kernel reads
    its outside inputs once and writes what is used outside once. The eager RMSNorm
    moves pow 2T, mean T + T/d, add 2T/d, rsqrt 2T/d, mul 2T + T/d, weight-mul 2T + 4d
    (T: one activation's bytes); fused it reads x and the weight and writes one
    output: 2T + 4d. The block's own residual add is one op: nothing to save."""
    d = 32
    graph = autopar.capture(nn.Sequential(NormBlock(d), NormBlock(d)), (torch.randn(2, 16, d),), dtype=torch.float32)
    block = graph.layers[0]
    for b, s in ((2, 16), (3, 40)):
        t = 4 * b * s * d
        assert evaluate(block.module_fusion_saved_fwd, b, s) == 5 * t + 6 * t // d
        assert evaluate(block.module_fusion_saved_bwd, b, s) > 0


class Split(nn.Module):
    """Two elementwise ops in one module, with or without a GEMM between them."""

    def __init__(self, d, gemm):
        super().__init__()
        self.w, self.gemm = nn.Parameter(torch.randn(d, d)), gemm

    def forward(self, x):
        y = x * 2
        if self.gemm:
            y = y @ self.w
        return torch.relu(y + 1) @ self.w


def test_a_gemm_splits_a_module_into_separate_chains():
    x = (torch.randn(2, 16, 32),)
    chained = autopar.capture(nn.Sequential(Split(32, False), Split(32, False)), x, dtype=torch.float32)
    split = autopar.capture(nn.Sequential(Split(32, True), Split(32, True)), x, dtype=torch.float32)
    t = 4 * 2 * 16 * 32
    # mul, add, relu fused: read x once, write relu's output once (was 2T + 2T + 2T)
    assert evaluate(chained.layers[0].module_fusion_saved_fwd, 2, 16) == 4 * t
    # mul | GEMM | add, relu: only add + relu are one chain
    assert evaluate(split.layers[0].module_fusion_saved_fwd, 2, 16) == 2 * t


def test_in_place_adds_into_a_layers_output_capture():
    """`y = self.o(a); y += h` is valid eager code; capture cuts layer outputs into
    leaf tensors (and fabricates repeated layers' outputs as leaves), which autograd
    refuses to modify in place: the cut now hands on a non-leaf alias, unpriced."""
    import torch.nn as nn

    import autopar

    class InplaceResidual(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 16)
            self.layers = nn.ModuleList(nn.ModuleDict(dict(ln=nn.LayerNorm(16), o=nn.Linear(16, 16)))
                                        for _ in range(3))
            self.head = nn.Linear(16, 32)

        def forward(self, x):
            h = self.emb(x)
            for l in self.layers:  # the root walks the ModuleDicts: each Linear is a layer
                y = l["o"](l["ln"](h))
                y += h
                h = y
            return self.head(h)

    graph = autopar.capture(InplaceResidual(), lambda b: (torch.zeros(b, 8, dtype=torch.long),))
    flops = {l.name: l.eval("fwd_flops", 2, 8) for l in graph.layers}
    assert flops["layers.2.o"] == flops["layers.0.o"] == 2 * 2 * 8 * 16 * 16, flops  # each priced as its GEMM


def test_a_model_without_a_stack_of_repeated_blocks_is_told_it_is_priced_in_one_piece():
    """Issue 32: a decoder that walks its own layers (x-transformers' TransformerWrapper)
    leaves capture no stack to cut: one layer with most parameters, priced whole. The
    graph says so, so the plan's coarse layout is not a surprise; a model with a stack
    gets no such note."""
    import torch
    import torch.nn as nn

    import autopar

    class Core(nn.Module):  # its sub-layers called by its own forward, no ModuleList of blocks
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 64)

        def forward(self, x):
            return self.c(self.b(self.a(x).relu()).relu())

    class Walker(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.core, self.out = nn.Embedding(32, 64), Core(), nn.Linear(64, 32)

        def forward(self, tokens):
            return self.out(self.core(self.emb(tokens)))

    graph = autopar.capture(Walker(), (torch.randint(0, 32, (2, 8)),))
    assert any("no stack of repeated blocks" in n and "layer core holds" in n for n in graph.notes), graph.notes
    from llama import llama_tiny
    model, example = llama_tiny()
    assert not any("no stack of repeated blocks" in n for n in autopar.capture(model, example(2)).notes)
