"""How lowering calls the user's model and reads what it returns.

Models as people write them return a logits tensor (examples/gpt.py) or a
Hugging Face `ModelOutput` (`LlamaForCausalLM(...)(input_ids).logits`). A
pipeline stage can only hand tensors to the next stage and to the loss, so
every stage returns *the logits tensor* and `loss_fn(logits, targets)` is
called on it, whatever the model returns:

  tensor              itself
  object with logits  `.logits` (transformers' ModelOutput, any dataclass-like)
  tuple / list        its first element (transformers with return_dict=False)

Hugging Face models are also called with `use_cache=False`: with the
default config they would build a KV cache on every training forward
(memory for nothing, and a cache object between pipeline stages). Their own
loss is used when the user gives no `loss_fn`: `model.loss_function` with
`labels` as targets (transformers shifts the labels itself: pass the input
ids as targets, -100 marks ignored positions). A Hugging Face model built
on the meta device is initialised by its own `_init_weights` (which also
refills the RoPE `inv_freq` buffers) unless the user passes `init_fn`.
"""
from __future__ import annotations

import inspect
import sys

import torch
import torch.nn as nn

from autopar.errors import AutoparError


def is_hf_model(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (checked without importing transformers)."""
    tf = sys.modules.get("transformers")
    return tf is not None and isinstance(model, getattr(tf, "PreTrainedModel", ()))


def forward_kwargs(model: nn.Module) -> dict:
    """Keyword arguments every training forward of this model gets."""
    if is_hf_model(model) and "use_cache" in inspect.signature(model.forward).parameters:
        return {"use_cache": False}
    return {}


def logits_of(out):
    """The tensor a stage hands on: the model's output, or its logits."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise AutoparError(
        f"the model returned {type(out).__name__}, which is neither a tensor nor an object with a "
        f"`.logits` tensor",
        hint="return the logits (or an output object with .logits); autopar computes the loss with "
             "loss_fn(logits, targets)")


def resolve_loss_fn(model: nn.Module, loss_fn):
    """The user's loss_fn, or a Hugging Face causal LM's own loss."""
    if loss_fn is not None:
        if not callable(loss_fn):
            raise AutoparError(f"loss_fn must be callable as loss_fn(logits, targets), got {type(loss_fn).__name__}")
        return loss_fn
    own = getattr(model, "loss_function", None) if is_hf_model(model) else None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if own is None or vocab is None:
        raise AutoparError(
            "autopar.compile needs loss_fn(logits, targets) returning the mean loss of a micro-batch",
            hint="e.g. loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()); "
                 "Hugging Face causal LMs may leave it out to use their own loss")
    return HFCausalLMLoss(own, int(vocab))


class HFCausalLMLoss:
    """`model.loss_function(logits, labels, vocab_size)`, as the model's forward
    computes it when given `labels`.

    A mean over each micro-batch's own tokens would weigh micro-batches
    (and dp ranks) with many ignored (-100) labels more than one big batch
    does. So, like transformers' Trainer, train_step sets `tokens_per_share`
    before each step: the global count of scored tokens divided by the
    number of shares the step averages over (micro-batches x dp ranks).
    Each micro-batch then returns sum / tokens_per_share, and the schedule's
    1/n and dp's average turn that into the mean over every scored token of
    the global batch: exactly `model(x, labels=y).loss` on the whole batch.
    """

    IGNORE_INDEX = -100  # transformers' default

    def __init__(self, fn, vocab_size: int):
        self.fn, self.vocab_size = fn, vocab_size
        self.tokens_per_share: float | None = None  # None: the plain per-micro-batch mean

    def scored_tokens(self, labels: torch.Tensor) -> torch.Tensor:
        """Tokens the loss scores: labels are shifted by one inside the loss."""
        return (labels[..., 1:] != self.IGNORE_INDEX).sum()

    def __call__(self, logits, labels):
        if self.tokens_per_share is None:
            return self.fn(logits=logits, labels=labels, vocab_size=self.vocab_size)
        return self.fn(logits=logits, labels=labels, vocab_size=self.vocab_size,
                       num_items_in_batch=torch.tensor(self.tokens_per_share, device=labels.device))

    def __repr__(self) -> str:
        return f"HFCausalLMLoss({getattr(self.fn, '__name__', self.fn)}, vocab_size={self.vocab_size})"


def default_init_fn(model: nn.Module):
    """The model's own per-module init for meta models: Hugging Face's
    `_init_weights` (weights, norms and RoPE buffers); None for other models."""
    init = getattr(model, "_init_weights", None) if is_hf_model(model) else None
    return init if callable(init) else None
