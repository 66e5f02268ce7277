"""Tensor-parallel dataflow: where DTensor must all-gather because the model
cuts a column-sharded dim (GPT's fused qkv split), and where the shard survives
a reshape into heads (Llama's wq/wk/wv, Megatron's view-then-split)."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
import gpt
import llama
from autopar.cli import main
from cost_models.workload import evaluate


def _preset(module, name):
    cfg = module.PRESETS[name]
    with torch.device("meta"):
        model = module.build_model(cfg)
    return cfg, autopar.capture(model, lambda b: module.example_inputs(b, cfg))


@pytest.fixture(scope="module")
def gpt_tiny():
    return _preset(gpt, "gpt_tiny")


@pytest.fixture(scope="module")
def llama_tiny():
    return _preset(llama, "llama_tiny")


def _op(block, kind):
    return next(op for op in block.ops if op.kind == kind)


@pytest.mark.parametrize("b,s", [(1, 16), (3, 11), (8, 64)])
def test_gpt_fused_qkv_split_is_gathered(gpt_tiny, b, s):
    cfg, graph = gpt_tiny
    h = cfg.hidden
    for block in graph.layers[1:-1]:
        # the whole qkv output (3h bf16 values per token) is all-gathered at the split
        assert evaluate(block.tp_gather_bytes, b, s) == 3 * b * s * h * 2
        assert not _op(block, "attention").tp_sharded
        # the projections around the core are still split (column qkv, row proj)...
        gemms = {op.name: op.tp_sharded for op in block.ops if op.kind == "gemm"}
        assert gemms == {"attn.qkv:addmm": True, "attn.proj:addmm": True, "mlp.fc:addmm": True,
                         "mlp.proj:addmm": True}
        assert block.tp_allreduces == 2
        # ...but of the saved activations only the MLP's (GELU input and output, 4h each) divide by tp;
        # q, k, v, the attention output and its log-sum-exp stay whole on every rank.
        assert evaluate(block.activation_bytes_tp_sharded, b, s) == 16 * b * s * h
        replicated = evaluate(block.activation_bytes - block.activation_bytes_tp_sharded, b, s)
        assert replicated >= 2 * b * s * h * (3 + 1)
    assert graph.layers[0].tp_gather_bytes == 0 and graph.layers[-1].tp_gather_bytes == 0


def test_gpt_attrs_still_see_the_attention_region(gpt_tiny):
    cfg, graph = gpt_tiny
    attrs = graph.layers[1].attrs
    # the qkv GEMM is an attention GEMM, not an MLP one, although its output is gathered
    assert attrs["ffn_hidden"] == 4 * cfg.hidden and attrs["kv_heads"] == cfg.heads


@pytest.mark.parametrize("b,s", [(1, 16), (4, 32)])
def test_llama_head_parallel_attention_stays_sharded(llama_tiny, b, s):
    cfg, graph = llama_tiny
    block = graph.layers[1]
    assert block.tp_gather_bytes == 0
    assert _op(block, "attention").tp_sharded
    # rotate-half RoPE splits head_dim, not the sharded head dim: still sharded
    assert all(op.tp_sharded for op in block.ops if op.name.startswith("attention:"))
    d, kv = cfg.dim // cfg.heads, cfg.kv_heads
    qkv_bytes = 2 * b * s * (cfg.dim + 2 * kv * d)
    assert evaluate(block.activation_bytes_tp_sharded, b, s) > qkv_bytes


class _FusedGateUp(nn.Module):
    """A SwiGLU MLP with w1 and w3 fused and chunked: the same cut of a sharded dim."""

    def __init__(self, h, f):
        super().__init__()
        self.w13 = nn.Linear(h, 2 * f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


class _HeadsThenNarrow(nn.Module):
    """Reshape the sharded dim into heads, then cut head_dim: no gather."""

    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.up = nn.Linear(h, 2 * h, bias=False)
        self.down = nn.Linear(h, h, bias=False)

    def forward(self, x):
        b, s, h = x.shape
        y = self.up(x).view(b, s, self.heads, 2 * h // self.heads)
        y = y.narrow(-1, 0, h // self.heads) * 2.0  # first half of each head
        return x + self.down(y.reshape(b, s, h))


class _FullSlice(nn.Module):
    """A slice that keeps the whole sharded dim cuts nothing."""

    def __init__(self, h):
        super().__init__()
        self.up = nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(4 * h, h, bias=False)

    def forward(self, x):
        y = self.up(x)
        return x + self.down(F.gelu(y[..., : y.shape[-1]]))


class _Stack(nn.Module):
    def __init__(self, make, n=2):
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _capture_block(make, h=32):
    graph = autopar.capture(_Stack(make), lambda b: (torch.randn(b, 16, h),))
    return next(layer for layer in graph.layers if layer.name.startswith("layers."))


def test_fused_gate_up_chunk_is_gathered_and_w2_stays_row_parallel():
    h, f = 32, 64
    block = _capture_block(lambda: _FusedGateUp(h, f), h)
    assert evaluate(block.tp_gather_bytes, 2, 16) == 2 * 16 * 2 * f * 2
    assert block.tp_allreduces == 1  # w2: row-parallel on its locally sliced input
    ops = {op.name: op.tp_sharded for op in block.ops}
    assert ops["w13:mm"] and ops["w2:mm"] and not ops[".:silu"] and not ops[".:mul"]


def test_reshape_into_heads_then_cutting_head_dim_stays_sharded():
    block = _capture_block(lambda: _HeadsThenNarrow(32, 4))
    assert block.tp_gather_bytes == 0
    assert all(op.tp_sharded for op in block.ops if op.kind == "gemm")
    assert next(op for op in block.ops if op.name == ".:mul").tp_sharded


def test_full_slice_is_not_a_cut():
    block = _capture_block(lambda: _FullSlice(32))
    assert block.tp_gather_bytes == 0
    assert next(op for op in block.ops if op.name == ".:gelu").tp_sharded


def test_inspect_json_reports_gather_bytes(capsys):
    assert main(["inspect", "examples/gpt.py:gpt_tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    block = data["layers"][1]
    h, s = 32, data["seq_len"]
    assert block["tp_gather_bytes"] == 3 * s * h * 2  # one sample
    assert block["expressions"]["tp_gather_bytes"] == "192*b*s"
    assert data["totals"]["tp_gather_bytes"] == 4 * block["tp_gather_bytes"]


@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_capture_matches_the_analytic_fused_qkv_split_block(attention):
    from cost_models.analytic import block as analytic_block

    cfg = gpt.GPTConfig(vocab_size=1000, seq_len=256, hidden=256, layers=2, heads=8, dropout=0.1,
                        attention_impl=attention)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    captured = autopar.capture(model, lambda b: gpt.example_inputs(b, cfg)).layers[1]
    spec = analytic_block(0, hidden=cfg.hidden, heads=cfg.heads, ffn_hidden=4 * cfg.hidden, dropout=True,
                          attention="flash" if attention == "sdpa" else "math", fused_qkv_split=True)
    for field in ("tp_gather_bytes", "activation_bytes_tp_sharded", "activation_bytes_tp_gathered",
                  "activation_bytes_selective_tp_sharded", "activation_bytes_selective_tp_gathered"):
        for b, s in [(1, 256), (4, 128)]:
            assert evaluate(getattr(captured, field), b, s) == evaluate(getattr(spec, field), b, s), field
    replicated = {op.name for op in captured.ops if op.tp_replicated}
    assert replicated and all(not op.tp_sharded for op in captured.ops if op.tp_replicated)
    assert not any(op.tp_replicated for op in captured.ops if op.kind == "gemm" and op.gemm and "proj" in op.name)
