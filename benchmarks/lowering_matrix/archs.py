"""Architectures for the lowering matrix, built the way users build them.

`ARCHS[name]()` returns an `Arch(model, example_inputs, targets_fn, loss_fn)`:

  model           a tiny random model (fixed seed, dropout 0), built with the
                  library's own classes (`XConfig` + `XForCausalLM`, torch's
                  `nn.Transformer`, plain user code)
  example_inputs  batch -> tuple of positional input tensors for one
                  micro-batch (random values from a fixed generator; pass
                  `generator=` for other draws): what autopar.compile gets
  targets_fn      (inputs, generator) -> targets (labels for a Hugging Face
                  model's own loss, or what loss_fn takes)
  loss_fn         None: the model computes its loss from `labels` (what a
                  user of transformers does: `model(*inputs, labels=y).loss`);
                  otherwise loss_fn(logits, targets)

`reference_loss(arch, model, inputs, targets)` is that same loss as one
process computes it, without autopar: `model(*inputs, labels=y).loss` or
`loss_fn(output, y)` with the output read as the user would (`.logits` of a
ModelOutput, or the tensor).

Sizes (arch_kit.py): hidden 64, 4 blocks (pipeline 2 x 2 virtual stages needs 4), heads 4
(kv heads 2 where the architecture has GQA), vocab 256, sequence 16 (ViT:
9 patches + class token = 10), so tp 2 and 4 divide heads and vocab and tp 2
divides every sequence; `llama_seq15` is the deliberately odd sequence.
`MISSING` lists registry entries whose classes this transformers lacks.
"""
from __future__ import annotations

import math
import os
import sys
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

# The shared pieces live in arch_kit.py, which archs_issue29.py imports too (downward, no
# circle); re-exported here for run.py and architecture files outside the repository.
from arch_kit import (DECODER, ENCODER, FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, MAX_POS, SEED, SEQ,  # noqa: F401
                      TOKENS, VOCAB, Arch, _causal, _gen, _masked_lm, _mlm_labels, _no_dropout, _random_labels,
                      _tf, _tokens, token_cross_entropy)

_EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


# -- transformers causal LMs ------------------------------------------------------------------
GQA = dict(num_key_value_heads=KV_HEADS)

HF_CAUSAL = {
    # controls: the four tested today (tests/test_lower_hf.py)
    "hf_llama": ("LlamaConfig", "LlamaForCausalLM", GQA),
    "hf_mistral": ("MistralConfig", "MistralForCausalLM", dict(GQA, sliding_window=None)),
    "hf_qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(GQA, tie_word_embeddings=False)),
    # beyond
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(GQA, head_dim=16)),  # embeddings * sqrt(hidden), tied
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",  # softcapping, sliding window 8 < seq, 4 norms per block
               dict(GQA, head_dim=16, query_pre_attn_scalar=16, sliding_window=8, attn_implementation="eager")),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(GQA, head_dim=16)),  # per-head q/k RMSNorm
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", GQA),  # q/k RMSNorm over the whole projection
    "phi": ("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.5)),  # parallel attn+MLP, dense, partial RoPE
    "phi3": ("Phi3Config", "Phi3ForCausalLM", GQA),  # fused qkv_proj and gate_up_proj
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(GQA, partial_rotary_factor=0.25)),
    "falcon": ("FalconConfig", "FalconForCausalLM",  # fused qkv, parallel attention, Falcon-40B style GQA
               dict(num_kv_heads=KV_HEADS, new_decoder_architecture=True, ffn_hidden_size=FFN)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(rotary_pct=0.25)),  # fused qkv, parallel residual
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=MAX_POS, rotary_dim=8, n_inner=FFN)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_layer=LAYERS, n_head=HEADS)),  # ALiBi, fused qkv
    "opt": ("OPTConfig", "OPTForCausalLM",  # learned positions with offset 2
            dict(ffn_dim=FFN, word_embed_proj_dim=HIDDEN, num_hidden_layers=LAYERS)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(GQA, sliding_window=None)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(GQA, logit_scale=0.25)),  # parallel block, LayerNorm
    "granite": ("GraniteConfig", "GraniteForCausalLM",  # scalar multipliers everywhere
                dict(GQA, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25,
                     logits_scaling=4.0)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(GQA, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # routed experts + gated shared expert
                  dict(GQA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=FFN, decoder_sparse_step=1)),
}


def hf_gpt2():
    """Control: Conv1D weights, fused qkv, tied head (tested today)."""
    tf = _tf()
    cfg = _no_dropout(tf.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                                    n_positions=MAX_POS, bos_token_id=0, eos_token_id=0))
    torch.manual_seed(SEED)
    return Arch(tf.GPT2LMHeadModel(cfg), _tokens(), _random_labels(), None)


def llama_seq15():
    """Llama with a 15-token sequence: no tp degree divides it."""
    return _causal("LlamaConfig", "LlamaForCausalLM", seq=15, **GQA)()


def distilbert():
    tf = _tf()
    cfg = _no_dropout(tf.DistilBertConfig(vocab_size=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS,
                                          hidden_dim=FFN, max_position_embeddings=MAX_POS))
    torch.manual_seed(SEED)
    return Arch(tf.DistilBertForMaskedLM(cfg), _tokens(), _mlm_labels(), None)


# -- encoder-decoders -------------------------------------------------------------------------
def _seq2seq_inputs(batch, generator=None):
    """(input_ids, attention_mask, decoder_input_ids): what the forward takes positionally."""
    g = _gen(generator)
    src = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    tgt = torch.randint(3, VOCAB, (batch, SEQ), generator=g)
    return src, torch.ones_like(src), tgt


def t5():
    tf = _tf()
    cfg = _no_dropout(tf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=FFN, num_layers=LAYERS,
                                  num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
                                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    torch.manual_seed(SEED)
    return Arch(tf.T5ForConditionalGeneration(cfg), _seq2seq_inputs, _random_labels(), None)


def bart():
    tf = _tf()
    cfg = _no_dropout(tf.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                    encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                    encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_position_embeddings=MAX_POS,
                                    pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2))
    torch.manual_seed(SEED)
    return Arch(tf.BartForConditionalGeneration(cfg), _seq2seq_inputs, _random_labels(), None)


# -- vision -----------------------------------------------------------------------------------
def vit(loss_fn=None):
    """ViTForImageClassification: 24x24 images, 8x8 patches -> 9 + class token = 10 positions."""
    tf = _tf()
    cfg = _no_dropout(tf.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                   intermediate_size=FFN, image_size=24, patch_size=8, num_channels=3,
                                   num_labels=10))
    torch.manual_seed(SEED)

    def images(batch, generator=None):
        return (torch.randn(batch, 3, 24, 24, generator=_gen(generator)),)

    def labels(inputs, generator):
        return torch.randint(0, 10, (inputs[0].shape[0],), generator=generator)
    return Arch(tf.ViTForImageClassification(cfg), images, labels, loss_fn)


# -- explicit-loss twins: the same models with loss_fn given, so the lowering is measured apart
#    from how autopar reproduces a model's own loss ------------------------------------------
def masked_cross_entropy(logits, targets):
    """Token cross-entropy ignoring -100 (masked-LM and seq2seq labels, no shift)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


def _twin(build, loss_fn, targets_fn=None):
    def make():
        arch = build()._replace(loss_fn=loss_fn)
        return arch._replace(targets_fn=targets_fn) if targets_fn else arch
    return make


# -- torch nn.Transformer / nn.TransformerEncoder in user wrappers ----------------------------
class TorchEncoderLM(nn.Module):
    """nn.TransformerEncoder (pre-norm, causal) with a user's embedding and head."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(MAX_POS, HIDDEN)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, dim_feedforward=FFN, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, norm=nn.LayerNorm(HIDDEN), enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, idx):
        s = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(s, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(s, device=idx.device)
        return self.head(self.encoder(x, mask=mask, is_causal=True))


class TorchSeq2Seq(nn.Module):
    """nn.Transformer (encoder-decoder) with a user's embeddings and head."""

    def __init__(self):
        super().__init__()
        self.src_tok = nn.Embedding(VOCAB, HIDDEN)
        self.tgt_tok = nn.Embedding(VOCAB, HIDDEN)
        self.transformer = nn.Transformer(HIDDEN, HEADS, num_encoder_layers=LAYERS, num_decoder_layers=LAYERS,
                                          dim_feedforward=FFN, dropout=0.0, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        y = self.transformer(self.src_tok(src), self.tgt_tok(tgt), tgt_mask=mask, tgt_is_causal=True)
        return self.head(y)


def torch_encoder():
    torch.manual_seed(SEED)
    return Arch(TorchEncoderLM(), _tokens(), _random_labels(), token_cross_entropy)


def torch_transformer():
    torch.manual_seed(SEED)

    def inputs(batch, generator=None):
        g = _gen(generator)
        return (torch.randint(0, VOCAB, (batch, SEQ), generator=g), torch.randint(0, VOCAB, (batch, SEQ), generator=g))
    return Arch(TorchSeq2Seq(), inputs, _random_labels(), token_cross_entropy)


# -- user code: a registered buffer, an in-place residual add, a block returning a tuple ------
class UserAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.o = nn.Linear(HIDDEN, HIDDEN)
        # causal mask as a registered buffer, read inside attention
        self.register_buffer("causal", torch.ones(MAX_POS, MAX_POS, dtype=torch.bool).tril())

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (f(x).view(b, s, HEADS, h // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // HEADS)
        att = att.masked_fill(~self.causal[:s, :s], float("-inf")).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(b, s, h))


class UserMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x, residual):
        out = self.down(F.gelu(self.up(x)))
        out += residual  # the residual passed in, added in place to the (row-parallel) output
        return out


class UserBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn, self.mlp = UserAttention(), UserMLP()

    def forward(self, x):
        a = self.attn(self.ln1(x))
        a += x  # in-place residual add
        return self.mlp(self.ln2(a), a), a  # a tuple: the caller keeps [0]


class UserLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(MAX_POS, HIDDEN)
        self.register_buffer("position_ids", torch.arange(MAX_POS))  # a registered buffer read in forward
        self.blocks = nn.ModuleList([UserBlock() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(self.position_ids[:idx.shape[1]])
        for block in self.blocks:
            x, _ = block(x)
        return self.head(self.norm(x))


def user_model():
    torch.manual_seed(SEED)
    return Arch(UserLM(), _tokens(), _random_labels(), token_cross_entropy)


# -- autopar's own examples (controls) --------------------------------------------------------
def _example(module: str, preset: str):
    def build():
        if _EXAMPLES not in sys.path:
            sys.path.insert(0, _EXAMPLES)
        mod = __import__(module)
        torch.manual_seed(SEED)
        model, _ = getattr(mod, preset)()
        cfg = mod.PRESETS[preset]
        vocab, seq = cfg.vocab_size, cfg.seq_len
        return Arch(model, _tokens(vocab=vocab, seq=seq), _random_labels(vocab=vocab, seq=seq), mod.loss_fn)
    return build


# -- the registry -----------------------------------------------------------------------------
CONTROLS = ["ex_gpt", "ex_llama", "hf_llama", "hf_gpt2", "hf_mistral", "hf_qwen2"]

ARCHS: dict[str, Callable[[], Arch]] = {
    "ex_gpt": _example("gpt", "gpt_tiny"),
    "ex_llama": _example("llama", "llama_tiny"),
    "hf_gpt2": hf_gpt2,
}
for _name, (_cfg, _cls, _kw) in HF_CAUSAL.items():
    ARCHS[_name] = _causal(_cfg, _cls, **_kw)
ARCHS.update({
    "bert": _masked_lm("BertConfig", "BertForMaskedLM"),
    "roberta": _masked_lm("RobertaConfig", "RobertaForMaskedLM", low=3, max_position_embeddings=MAX_POS + 2,
                          pad_token_id=1, bos_token_id=0, eos_token_id=2),
    "electra": _masked_lm("ElectraConfig", "ElectraForMaskedLM", embedding_size=32),  # embeddings_project 32 -> 64
    "distilbert": distilbert,
    "t5": t5,
    "bart": bart,
    "vit": vit,
    "torch_encoder": torch_encoder,
    "torch_transformer": torch_transformer,
    "user_model": user_model,
    # Megatron-style blocks calling qkv, proj, fc1, fc2 themselves (no attention / MLP module)
    "ex_gpt_flat": _example("gpt_flat", "gpt_flat_tiny"),
    "llama_seq15": llama_seq15,
    # explicit-loss twins (not counted among the architectures)
    # every position scored: the lowering alone
    "bert_ce": _twin(_masked_lm("BertConfig", "BertForMaskedLM"), masked_cross_entropy, _random_labels()),
    # a quarter scored (-100 elsewhere), the user's loss a mean over scored tokens
    "bert_ce_ignore": _twin(_masked_lm("BertConfig", "BertForMaskedLM"), masked_cross_entropy),
    "t5_ce": _twin(t5, masked_cross_entropy),
    "vit_ce": lambda: vit(F.cross_entropy),
})
ORDER = CONTROLS + [n for n in ARCHS if n not in CONTROLS]
ARCHS = {n: ARCHS[n] for n in ORDER}

FAMILY = {
    **{n: "control" for n in CONTROLS},
    **{n: "causal LM" for n in HF_CAUSAL if n not in CONTROLS},
    "mixtral": "MoE causal LM", "qwen2_moe": "MoE causal LM",
    "bert": "encoder (MLM)", "roberta": "encoder (MLM)", "electra": "encoder (MLM)", "distilbert": "encoder (MLM)",
    "t5": "encoder-decoder", "bart": "encoder-decoder", "vit": "vision", "torch_encoder": "torch nn",
    "torch_transformer": "torch nn", "user_model": "user code", "ex_gpt_flat": "user code",
    "llama_seq15": "odd sequence",
    "bert_ce": "explicit-loss twin", "bert_ce_ignore": "explicit-loss twin", "t5_ce": "explicit-loss twin", "vit_ce": "explicit-loss twin",
}


def _missing() -> list[str]:
    """Registry entries whose transformers classes this installation lacks."""
    try:
        tf = _tf()
    except ImportError:
        return [n for n, f in FAMILY.items() if f not in ("control", "torch nn", "user code")]
    need = {n: (c, m) for n, (c, m, _) in HF_CAUSAL.items()}
    need.update({"bert": ("BertConfig", "BertForMaskedLM"), "roberta": ("RobertaConfig", "RobertaForMaskedLM"),
                 "electra": ("ElectraConfig", "ElectraForMaskedLM"),
                 "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM"),
                 "t5": ("T5Config", "T5ForConditionalGeneration"),
                 "bart": ("BartConfig", "BartForConditionalGeneration"),
                 "vit": ("ViTConfig", "ViTForImageClassification"), "hf_gpt2": ("GPT2Config", "GPT2LMHeadModel"),
                 "llama_seq15": ("LlamaConfig", "LlamaForCausalLM")})
    need.update({"bert_ce": need["bert"], "bert_ce_ignore": need["bert"], "t5_ce": need["t5"], "vit_ce": need["vit"]})
    return [n for n, names in need.items() if not all(hasattr(tf, x) for x in names)]


MISSING = _missing()
for _n in MISSING:
    ARCHS.pop(_n, None)
ORDER = [n for n in ORDER if n in ARCHS]

# Issue 29's architectures (a module of their own; it reads the helpers above).
import archs_issue29 as _more  # noqa: E402

ARCHS.update(_more.ARCHS)
FAMILY.update(_more.FAMILY)
ORDER += list(_more.ARCHS)
try:
    _tf_classes = _tf()
    MISSING += [n for n, names in _more.NEEDS.items() if not all(hasattr(_tf_classes, x) for x in names)]
except ImportError:
    MISSING += list(_more.NEEDS)
for _n in MISSING:
    ARCHS.pop(_n, None)
ORDER = [n for n in ORDER if n in ARCHS]


def _load_outside(paths: str) -> None:
    """Architectures kept outside this repository (run.py --archs-file, passed to every
    rank in AUTOPAR_MATRIX_ARCHS): each file defines ARCHS {name: () -> Arch}, and FAMILY."""
    import importlib.util
    for path in filter(None, paths.split(os.pathsep)):
        spec = importlib.util.spec_from_file_location(f"outside_archs_{len(ORDER)}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # its sibling imports
        spec.loader.exec_module(mod)
        ARCHS.update(mod.ARCHS)
        FAMILY.update({n: "outside" for n in mod.ARCHS})
        FAMILY.update(getattr(mod, "FAMILY", {}))
        ORDER.extend(n for n in mod.ARCHS if n not in ORDER)


_load_outside(os.environ.get("AUTOPAR_MATRIX_ARCHS", ""))


def output_tensor(out):
    """What a user reads from the model's output: the tensor, `.logits`, or `["logits"]`."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["logits"]  # a user's dict output (archs_issue29.DictLM)
    return out.logits if hasattr(out, "logits") else out[0]


def reference_loss(arch: Arch, model: nn.Module, inputs: tuple, targets: torch.Tensor) -> torch.Tensor:
    """The loss as one process computes it, the way the user trains the model."""
    if arch.loss_fn is None:
        return model(*inputs, labels=targets).loss
    return arch.loss_fn(output_tensor(model(*inputs)), targets)
