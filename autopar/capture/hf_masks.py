"""Hugging Face mask preparation on the meta device.

transformers decides *by reading the attention mask's values* whether a batch
is padded or packed (`padding_mask.all()`, `(position_diff != 1).cumsum()`...),
and when it is not, skips building the (s x s) mask so SDPA runs its causal
flash kernel. Meta tensors have no values, so each such check would stop
capture as data-dependent control flow (and transformers' own escape hatch
for tracers, `is_tracing`, takes the slow path: a materialised mask and no
`is_causal`, which is not what a training run does).

Capture therefore answers those checks as a pretraining batch would: no
padding, no packed sequences (and skips the padding warning of models called
without a mask). The patch is process-wide while capture runs,
touches only `transformers.masking_utils` if it is already imported (capture
never imports transformers), and is always restored. A model trained on padded
batches builds one boolean (b, 1, s, s) mask per step in addition; its
attention then runs the memory-efficient kernel with the same saved tensors.
"""
from __future__ import annotations

import contextlib
import sys


def _unpadded(original):
    def check(padding_mask, *args, **kwargs):
        return original(None, *args, **kwargs)
    return check


@contextlib.contextmanager
def assume_unpadded_batches():
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    patches = {
        "find_packed_sequence_indices": lambda position_ids: None,  # one sequence per row
        "fast_all": lambda tensor: True,  # every token is real
    }
    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        if hasattr(masking, name):
            patches[name] = _unpadded(getattr(masking, name))
    saved = {name: getattr(masking, name) for name in patches if hasattr(masking, name)}
    for name in saved:
        setattr(masking, name, patches[name])
    # BERT-family forwards called without an attention mask look for padding in the
    # ids only to print a warning (`pad_token_id in input_ids[:, [-1, 0]]`, DeBERTa-v2):
    # a value read, no effect on what runs.
    model_cls = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    warn = getattr(model_cls, "warn_if_padding_and_no_attention_mask", None)
    if warn is not None:
        model_cls.warn_if_padding_and_no_attention_mask = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(masking, name, value)
        if warn is not None:
            model_cls.warn_if_padding_and_no_attention_mask = warn
