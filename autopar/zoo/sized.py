"""A standard decoder of a given size (`autopar plan --model-size 6B --gpus 32`), as
DeepSpeed-style config generators are asked for one (`--model_size 6B --num_gpus 32`).

A model file whose factories are named by family and size: `sized.py:gpt3_6B`,
`sized.py:llama3_70B` (module `__getattr__`). A published size takes its published
shape (GPT-3 paper, Table 2.1; Meta's Llama 3 cards); any other size keeps the
width, heads and feed-forward of the family's nearest published size and sets the
depth to come closest to the size asked (the parameter count is stated, and is
the model's own count, not the name's).
"""
from __future__ import annotations

import math
import re

from autopar.zoo.gpt import GPT, GPTConfig
from autopar.zoo.gpt import example_inputs as _gpt_inputs
from autopar.zoo.gpt import loss_fn  # noqa: F401  (this file's loss, as for every decoder here)
from autopar.zoo.llama import Llama, LlamaConfig
from autopar.zoo.llama import example_inputs as _llama_inputs

FAMILIES = ("gpt3", "llama3")
# GPT-3 (Brown et al. 2020, Table 2.1): layers, hidden, heads; vocabulary 50,257, context 2,048
GPT3 = {"125M": (12, 768, 12), "350M": (24, 1024, 16), "760M": (24, 1536, 16), "1.3B": (24, 2048, 16),
        "2.7B": (32, 2560, 32), "6.7B": (32, 4096, 32), "13B": (40, 5120, 40), "175B": (96, 12288, 96)}
# Llama 3 (Meta's model cards): layers, hidden, heads, kv heads, feed-forward; vocabulary 128,256
LLAMA3 = {"8B": (32, 4096, 32, 8, 14336), "70B": (80, 8192, 64, 8, 28672), "405B": (126, 16384, 128, 8, 53248)}
GPT3_SEQ, LLAMA3_SEQ = 2048, 8192


def parse_size(text: str) -> float:
    """'6B' -> 6e9, '125M' -> 1.25e8, '1.3b' -> 1.3e9."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMbBtT])\s*", str(text))
    if not m:
        raise ValueError(f"model size {text!r}: expected a number and a unit, e.g. 125M, 6B, 1.3B, 1T")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]


def _published(table: dict, size: str) -> str | None:
    want = parse_size(size)
    return next((k for k in table if math.isclose(parse_size(k), want)), None)


def _nearest(table: dict, size: str) -> str:
    want = parse_size(size)
    return min(table, key=lambda k: abs(math.log(parse_size(k) / want)))


def gpt3_config(size: str, seq_len: int | None = None) -> GPTConfig:
    seq = seq_len or GPT3_SEQ
    exact = _published(GPT3, size)
    layers, hidden, heads = GPT3[exact or _nearest(GPT3, size)]
    if exact is None:
        per_layer = 12 * hidden * hidden + 13 * hidden  # qkv, proj, 4h MLP with biases, 2 LayerNorms
        rest = (50257 + seq) * hidden + 2 * hidden  # tied token and position embeddings, final norm
        layers = _check_depth(round((parse_size(size) - rest) / per_layer), "gpt3", size, _nearest(GPT3, size))
    return GPTConfig(seq_len=seq, hidden=hidden, layers=layers, heads=heads)


def llama3_config(size: str, seq_len: int | None = None) -> LlamaConfig:
    exact = _published(LLAMA3, size)
    layers, dim, heads, kv, ffn = LLAMA3[exact or _nearest(LLAMA3, size)]
    if exact is None:
        per_layer = dim * dim * 2 + 2 * dim * (dim // heads) * kv + 3 * dim * ffn + 2 * dim
        rest = 2 * 128256 * dim + dim  # untied embedding and output, final norm
        layers = _check_depth(round((parse_size(size) - rest) / per_layer), "llama3", size, _nearest(LLAMA3, size))
    return LlamaConfig(seq_len=seq_len or LLAMA3_SEQ, dim=dim, layers=layers, heads=heads, kv_heads=kv,
                       ffn_hidden=ffn)


def _check_depth(layers: int, family: str, size: str, nearest: str) -> int:
    if layers < 8:
        raise ValueError(f"--model-size {size} is too small for the {family} family's narrowest published width "
                         f"({nearest}: {layers} layer(s) would hold it); use --family gpt3 for small models, or "
                         f"a model file")
    return layers


def describe(family: str, size: str, seq_len: int | None = None) -> str:
    """The shape a size resolves to, in words, for the CLI to state."""
    if family == "gpt3":
        c = gpt3_config(size, seq_len)
        shape = f"{c.layers} layers x hidden {c.hidden}, {c.heads} heads, vocabulary {c.vocab_size}"
        how = "GPT-3's published shape" if _published(GPT3, size) else \
            f"GPT-3 {_nearest(GPT3, size)}'s width, depth set to the size"
    else:
        c = llama3_config(size, seq_len)
        shape = (f"{c.layers} layers x hidden {c.dim}, {c.heads} heads ({c.kv_heads} kv), feed-forward "
                 f"{c.ffn_hidden}, vocabulary {c.vocab_size}")
        how = "Llama 3's published shape" if _published(LLAMA3, size) else \
            f"Llama 3 {_nearest(LLAMA3, size)}'s width, depth set to the size"
    name = {"gpt3": "GPT-3-style", "llama3": "Llama-3-style"}[family]
    return f"a {name} decoder of {size}: {shape}, sequence {c.seq_len} ({how})"


def _factory(family: str, size: str):
    def make():
        if family == "gpt3":
            cfg = gpt3_config(size)
            return GPT(cfg), lambda batch_size: _gpt_inputs(batch_size, cfg)
        cfg = llama3_config(size)
        return Llama(cfg), lambda batch_size: _llama_inputs(batch_size, cfg)
    make.__name__ = f"{family}_{size}"
    return make


def __getattr__(name: str):
    """`gpt3_6B`, `llama3_70B`, `gpt3_1.3B`: the factory of that family and size."""
    family, _, size = name.partition("_")
    if family in FAMILIES and size:
        try:
            parse_size(size)
        except ValueError:
            pass
        else:
            return _factory(family, size)
    raise AttributeError(name)


def build_model():
    """The file's default model: GPT-3 125M."""
    return _factory("gpt3", "125M")()[0]


def example_inputs(batch_size: int) -> tuple:
    return _gpt_inputs(batch_size, gpt3_config("125M"))


def spec_for(family: str, size: str) -> str:
    """The model-file spec `--model-size SIZE --family FAMILY` stands for."""
    if family not in FAMILIES:
        raise ValueError(f"--family {family!r}: one of {', '.join(FAMILIES)}")
    parse_size(size)
    return f"{__file__}:{family}_{size}"
