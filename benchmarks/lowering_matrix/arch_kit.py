"""What every architecture of the lowering matrix is built from: the sizes, the `Arch`
record, input and label makers, the token losses, and the builders of a transformers
causal or masked LM from its config class.

`archs.py` (the registry), `archs_issue29.py` and files kept outside the repository
import these; `archs.py` re-exports them, so `from archs import Arch, _tokens, ...`
keeps working. This module imports nothing of the matrix's own.

Sizes: hidden 64, 4 blocks (pipeline 2 x 2 virtual stages needs 4), heads 4
(kv heads 2 where the architecture has GQA), vocab 256, sequence 16 (ViT:
9 patches + class token = 10), so tp 2 and 4 divide heads and vocab and tp 2
divides every sequence.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = 0
VOCAB = 256
HIDDEN = 64
FFN = 128
LAYERS = 4
HEADS = 4
KV_HEADS = 2
SEQ = 16
MAX_POS = 64

class Arch(NamedTuple):
    model: nn.Module
    example_inputs: Callable[..., tuple]
    targets_fn: Callable | None
    loss_fn: Callable | None


def _gen(generator):
    return generator if generator is not None else torch.Generator().manual_seed(1234)


def _tokens(vocab=VOCAB, seq=SEQ, low=0):
    def make(batch, generator=None):
        return (torch.randint(low, vocab, (batch, seq), generator=_gen(generator)),)
    return make


def _random_labels(vocab=VOCAB, seq=SEQ):
    def make(inputs, generator):
        return torch.randint(0, vocab, (inputs[0].shape[0], seq), generator=generator)
    return make


def _mlm_labels(vocab=VOCAB):
    """Masked-LM labels: a quarter of the positions scored, the rest -100."""
    def make(inputs, generator):
        x = inputs[0]
        y = torch.randint(0, vocab, x.shape, generator=generator)
        keep = torch.rand(x.shape, generator=generator) < 0.25
        keep[:, 0] = True  # every row scores at least one token
        return y.masked_fill(~keep, -100)
    return make


def token_cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _no_dropout(cfg):
    for k, v in list(vars(cfg).items()):
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k or k.endswith("_drop")):
            setattr(cfg, k, 0.0)
    return cfg


def _tf():
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers


TOKENS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DECODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, max_position_embeddings=MAX_POS, **TOKENS)


def _causal(config_cls: str, model_cls: str, seq=SEQ, **kw):
    """A transformers causal LM: `XForCausalLM(XConfig(...))`, its own loss."""
    def build():
        tf = _tf()
        cfg = _no_dropout(getattr(tf, config_cls)(**{**DECODER, **kw}))
        torch.manual_seed(SEED)
        model = getattr(tf, model_cls)(cfg)
        return Arch(model, _tokens(seq=seq), _random_labels(seq=seq), None)
    return build


# -- transformers masked LMs (encoders) ------------------------------------------------------
ENCODER = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               intermediate_size=FFN, max_position_embeddings=MAX_POS)


def _masked_lm(config_cls, model_cls, low=0, **kw):
    def build():
        tf = _tf()
        cfg = _no_dropout(getattr(tf, config_cls)(**{**ENCODER, **kw}))
        torch.manual_seed(SEED)
        return Arch(getattr(tf, model_cls)(cfg), _tokens(low=low), _mlm_labels(), None)
    return build
