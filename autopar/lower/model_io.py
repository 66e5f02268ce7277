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


TARGET_KEYS = ("labels", "targets")


def positional_inputs(model: nn.Module, example_inputs):
    """Capture's inferred inputs for Hugging Face / nanoGPT-style models are
    keywords (`({"input_ids": x, "labels": y, "use_cache": False},)`), while
    lowering feeds the model positional tensors and takes the labels as
    train_step's targets (they must be split into micro-batches and sent
    between stages). Returns `batch -> (inputs tuple, targets or None)`, or
    None when the inputs are positional already. The keyword tensors must be
    the first parameters of the model's forward, in its order."""
    make = example_inputs if callable(example_inputs) else (lambda batch: example_inputs)
    first = make(1)
    first = tuple(first) if isinstance(first, (tuple, list)) else (first,)
    if not first or not isinstance(first[-1], dict):
        return None
    params = [n for n in inspect.signature(model.forward).parameters if n not in ("self",)]

    def split(batch: int):
        args = make(batch)
        args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
        *positional, kw = args
        targets = next((kw[k] for k in TARGET_KEYS if isinstance(kw.get(k), torch.Tensor)), None)
        tensors = {k: v for k, v in kw.items() if isinstance(v, torch.Tensor) and k not in TARGET_KEYS}
        order = params[len(positional):len(positional) + len(tensors)]
        if sorted(order) != sorted(tensors):
            raise AutoparError(
                f"the keyword inputs {sorted(tensors)} are not the first parameters of "
                f"{type(model).__name__}.forward ({', '.join(params[:6])}, ...): they cannot be fed positionally",
                hint="give the model file an example_inputs(batch_size) returning positional tensors")
        return tuple(positional) + tuple(tensors[k] for k in order), targets
    return split


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
