"""Example inputs for models whose file only builds the model.

A model file should say what one batch looks like (`example_inputs(batch_size)`),
but most files people bring only construct the model: a Hugging Face
`...ForCausalLM(config)`, Karpathy's nanoGPT `GPT(GPTConfig(...))`. For the
common cases the inputs follow from the model itself:

- Hugging Face models (`main_input_name`, `config`):
  - `input_ids`: token ids `(batch, seq)` in `[0, config.vocab_size)`;
    encoder-only models (BERT: cannot generate) also get an all-ones
    `attention_mask`; encoder-decoders (T5) get `decoder_input_ids` of the
    same length; decoder-only models get no mask, so attention stays on the
    causal flash path a training run takes.
  - `pixel_values`: images `(batch, config.num_channels, H, W)` with H, W from
    `config.image_size`.
  - `labels` shaped as the head class takes them (token ids for LM heads,
    class ids for classifiers; none for base models), so the model's own loss
    (the fp32 logits and log-softmax of a causal-LM head) is costed like a
    training step; `use_cache=False` (training keeps no KV cache).
- Other modules: the first parameterised leaf module decides. An
  `nn.Embedding` means token ids in `[0, num_embeddings)` (plus `targets` /
  `labels` as its second parameter: nanoGPT computes full-sequence logits
  only with targets); an `nn.Conv2d` means images of its input channels at
  `model.image_size` (or the config's), else 224 x 224. A forward with other
  required inputs (`forward(src, src_mask)`) is not guessed.

The sequence length is `seq_len` when given (the CLI's --seq-len), else the
model's position limit capped at 2048 (`min(config.max_position_embeddings,
2048)`; also `n_positions`, `block_size`, `max_seq_len`... on `config`,
`model_args`, `params` or the model), else 2048 for models without one
(relative or rotary positions with no configured limit). `InferredInputs.description` says which was used, and
the CLI prints it. Longer than a learned position table is refused: on the
meta device an out-of-range position index would not fail, it would be costed.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from autopar.errors import ModelFileError

DEFAULT_MAX_SEQ = 2048
# Config / module attributes that name a model's maximum sequence length, most specific first.
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "block_size", "max_seq_len", "max_sequence_length",
                    "context_length", "seq_len", "n_ctx", "max_len")
_TARGET_NAMES = ("labels", "targets", "target", "y")
# Where models keep their config: HF/nanoGPT `config`, torchtitan `model_args`, Meta's llama `params`.
_CONFIG_ATTRS = ("config", "model_args", "cfg", "args", "params")
_POSITION_TABLE = re.compile(r"(^|\.)(wpe|pos\w*|position\w*)$")
_DEFAULT_IMAGE = 224


@dataclass(frozen=True)
class InferredInputs:
    """A callable `batch_size -> (kwargs,)`, plus what it is and why."""
    fn: Callable[[int], tuple]
    description: str
    seq_len: int | None
    computes_loss: bool = False  # labels/targets are passed: the model's forward returns its loss

    def __call__(self, batch_size: int) -> tuple:
        return self.fn(batch_size)


def infer_example_inputs(model: nn.Module, seq_len: int | None = None) -> InferredInputs | None:
    """Inputs for `model`, or None when nothing can be inferred (the caller
    keeps asking for example_inputs). Raises ModelFileError for a seq_len the
    model cannot take."""
    if seq_len is not None and seq_len < 1:
        raise ModelFileError(f"--seq-len must be a positive integer, got {seq_len}")
    if _is_hugging_face(model):
        return _hugging_face_inputs(model, seq_len)
    return _plain_module_inputs(model, seq_len)


# -- Hugging Face ---------------------------------------------------------------
def _is_hugging_face(model: nn.Module) -> bool:
    return isinstance(getattr(model, "main_input_name", None), str) and hasattr(getattr(model, "config", None),
                                                                                 "to_dict")


def _hugging_face_inputs(model: nn.Module, seq_len: int | None) -> InferredInputs | None:
    config, main = model.config, model.main_input_name
    params = _forward_params(model)
    extra = {"use_cache": False} if "use_cache" in params else {}
    if main == "pixel_values":
        channels = getattr(config, "num_channels", None) or 3
        height, width = _image_size(getattr(config, "image_size", None))
        if height is None:
            return None
        labels = _class_labels(config) if "labels" in params else None

        def images(batch_size: int) -> tuple:
            kwargs = {"pixel_values": torch.randn(batch_size, channels, height, width,
                                                  generator=torch.Generator().manual_seed(0))}
            if labels is not None:
                kwargs["labels"] = _tokens(batch_size, None, labels)
            return (kwargs,)

        what = f"pixel_values (batch, {channels}, {height}, {width}) from config.image_size"
        if labels is not None:
            what += f", labels (batch,) in [0, {labels})"
        return InferredInputs(images, what, None, computes_loss=labels is not None)
    if main != "input_ids":
        return None  # audio (input_values / input_features) and others: the file must say
    vocab = getattr(config, "vocab_size", None)
    if not vocab:
        return None
    seq, why = _sequence_length(model, [config], seq_len)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    encoder_only = not encoder_decoder and not _can_generate(model)
    mask = encoder_only and "attention_mask" in params
    decoder = encoder_decoder and "decoder_input_ids" in params
    labels = _label_kind(model, vocab) if "labels" in params else None

    def tokens(batch_size: int) -> tuple:
        kwargs = {"input_ids": _tokens(batch_size, seq, vocab)}
        if mask:
            kwargs["attention_mask"] = torch.ones(batch_size, seq, dtype=torch.long)
        if decoder:
            kwargs["decoder_input_ids"] = _tokens(batch_size, seq, vocab, seed=1)
        if labels:
            per_token, classes = labels
            kwargs["labels"] = _tokens(batch_size, seq if per_token else None, classes, seed=2)
        kwargs.update(extra)
        return (kwargs,)

    parts = [f"input_ids (batch, {seq}) in [0, {vocab})"]
    parts += ["attention_mask of ones"] if mask else []
    parts += [f"decoder_input_ids (batch, {seq})"] if decoder else []
    if labels:
        shape = f"(batch, {seq})" if labels[0] else "(batch,)"
        parts += [f"labels {shape} in [0, {labels[1]}): the model's own loss is costed"]
    return InferredInputs(tokens, f"{', '.join(parts)}; seq {seq} {why}", seq, computes_loss=bool(labels))


# transformers head classes by what their `labels` are: (one per token?, over the vocabulary?)
_LABELS = (("ForCausalLM", (True, True)), ("LMHeadModel", (True, True)), ("ForMaskedLM", (True, True)),
           ("ForConditionalGeneration", (True, True)), ("ForPreTraining", None),
           ("ForTokenClassification", (True, False)), ("ForSequenceClassification", (False, False)))


def _label_kind(model: nn.Module, vocab: int) -> tuple[bool, int] | None:
    """(per_token, number of classes) of the labels the model's loss takes, or
    None when the head is not one whose labels are known (question answering,
    pretraining heads with several label tensors): then no labels are passed."""
    name = type(model).__name__
    for suffix, kind in _LABELS:
        if name.endswith(suffix):
            if kind is None:
                return None
            per_token, over_vocab = kind
            classes = vocab if over_vocab else _class_labels(model.config)
            return (per_token, classes) if classes else None
    return None


def _can_generate(model: nn.Module) -> bool:
    try:
        return bool(model.can_generate())
    except Exception:  # older or custom classes without the classmethod
        return type(model).__name__.endswith(("ForCausalLM", "LMHeadModel"))


def _image_size(value) -> tuple:
    if isinstance(value, int) and value > 0:
        return value, value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return tuple(value)
    return None, None


def _class_labels(config) -> int | None:
    n = getattr(config, "num_labels", None)
    return n if isinstance(n, int) and n > 1 else None


# -- plain nn.Modules (nanoGPT, torchvision, hand-written) ------------------------
def _plain_module_inputs(model: nn.Module, seq_len: int | None) -> InferredInputs | None:
    params = _forward_params(model)
    positional = [name for name, p in params.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional:
        return None
    targets = next((n for n in positional[1:2] if n in _TARGET_NAMES), None)
    required = [n for n in positional[1:] if params[n].default is inspect.Parameter.empty and n != targets]
    if required:
        return None  # forward(src, src_mask): what the other inputs are is the file's to say
    first = _first_leaf_with_params(model)
    if isinstance(first, nn.Embedding):
        vocab = first.num_embeddings
        configs = [c for c in (getattr(model, a, None) for a in _CONFIG_ATTRS) if c is not None]
        seq, why = _sequence_length(model, configs + [model], seq_len)

        def tokens(batch_size: int) -> tuple:
            ids = _tokens(batch_size, seq, vocab)
            return (ids, _tokens(batch_size, seq, vocab, seed=2)) if targets else (ids,)

        what = f"{positional[0]} (batch, {seq}) in [0, {vocab}) from the first nn.Embedding"
        if targets:
            what += f", {targets} (batch, {seq}): the model's own loss is costed"
        return InferredInputs(tokens, f"{what}; seq {seq} {why}", seq, computes_loss=bool(targets))
    if isinstance(first, nn.Conv2d):
        channels = first.in_channels
        config = getattr(model, "config", None)
        size = getattr(model, "image_size", None) or getattr(config, "image_size", None)
        height, width = _image_size(size)
        why = "from image_size"
        if height is None:
            height = width = _DEFAULT_IMAGE
            why = "(assumed: the model names no image_size; define example_inputs to change it)"

        def images(batch_size: int) -> tuple:
            return (torch.randn(batch_size, channels, height, width, generator=torch.Generator().manual_seed(0)),)

        return InferredInputs(images, f"{positional[0]} (batch, {channels}, {height}, {width}) {why}", None)
    return None


def _first_leaf_with_params(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None:
            return module
    return None


# -- shared -----------------------------------------------------------------------
def _forward_params(model: nn.Module) -> dict:
    try:
        return dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}


def _sequence_length(model: nn.Module, sources: list, seq_len: int | None) -> tuple[int, str]:
    """(seq, why) and a check against a learned position table."""
    limit, limit_name = None, None
    for source in sources:
        for attr in _POSITION_LIMITS:
            value = getattr(source, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                limit, limit_name = value, f"{'config.' if source is not model else ''}{attr}"
                break
        if limit:
            break
    table = learned_position_table(model)
    if seq_len is not None:
        seq, why = seq_len, "(from --seq-len)"
    elif limit:
        seq = min(limit, DEFAULT_MAX_SEQ)
        why = f"(= min({limit_name} {limit}, {DEFAULT_MAX_SEQ}); pass --seq-len to change)"
    else:
        seq, why = DEFAULT_MAX_SEQ, f"(default: the model names no position limit; pass --seq-len to change)"
    if table is not None and seq > table[1]:
        raise ModelFileError(f"sequence length {seq} is longer than the model's learned position table "
                             f"{table[0]} ({table[1]} positions)",
                             hint=f"pass --seq-len {table[1]} or less, or build the model with more positions")
    return seq, why


def learned_position_table(model: nn.Module) -> tuple[str, int] | None:
    """(module path, positions) of an absolute position-embedding table (GPT-2's
    `wpe`, BERT's `position_embeddings`), or None for relative/rotary positions."""
    for path, module in model.named_modules():
        if isinstance(module, nn.Embedding) and _POSITION_TABLE.search(path) and "relative" not in path:
            return path, module.num_embeddings
    return None


def _tokens(batch_size: int, seq: int | None, vocab: int, seed: int = 0) -> torch.Tensor:
    """Deterministic token ids (real values: lowering may run the model on them)."""
    shape = (batch_size,) if seq is None else (batch_size, seq)
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
