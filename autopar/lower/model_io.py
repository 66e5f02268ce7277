"""How lowering calls the user's model and reads what it returns.

Models as people write them return a logits tensor (examples/gpt.py) or a
Hugging Face `ModelOutput` (`LlamaForCausalLM(...)(input_ids).logits`). A
pipeline stage can only hand tensors to the next stage and to the loss, so
every stage returns *the logits tensor* and `loss_fn(logits, targets)` is
called on it, whatever the model returns (`logits_of`):

  tensor              itself
  object with logits  `.logits` (transformers' ModelOutput, a dataclass or
                      namedtuple with a `logits` field)
  mapping, dataclass  its "logits" entry (field), else its only tensor:
                      {"logits": t, "aux": ...} and {"out": t} give t
  tuple / list        its first element (transformers with return_dict=False)

"logits" is the one name trusted because it is what the loss is called with
(`loss_fn(logits, targets)`, transformers' outputs). Among several tensors
under other names ("out", "pred", "y") autopar does not guess: training on
the wrong one would run without any error. Such an output, or one with no
tensor, is refused by `autopar.compile` and `autopar compile` before
planning or lowering (`check_output`: one forward on fake tensors), with
what the model returned and how to return the logits.

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

import contextlib
import dataclasses
import inspect
import sys
from collections.abc import Mapping

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from autopar.errors import AutoparError, ModelOutputError


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
    """The tensor a stage hands on: the model's output, or its logits (see the table above)."""
    logits = _logits_or_none(out)
    if logits is None:
        raise _output_error(out)
    return logits


def _logits_or_none(out):
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    fields = _named_fields(out)
    if fields is not None:
        if isinstance(fields.get("logits"), torch.Tensor):
            return fields["logits"]
        tensors = [v for v in fields.values() if isinstance(v, torch.Tensor)]
        return tensors[0] if len(tensors) == 1 else None
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _named_fields(out) -> dict | None:
    """A mapping's items or a dataclass instance's fields; None for anything else
    (a namedtuple is a tuple: its first element, unless it has a `logits` field)."""
    if isinstance(out, Mapping):
        return dict(out)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return None


def _output_error(out) -> ModelOutputError:
    def kind(v):
        return f"tensor{tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
    fields = _named_fields(out)
    if fields is None:
        first = f" starting with {kind(out[0])}" if isinstance(out, (tuple, list)) and out else ""
        what = "None" if out is None else f"a value of type {type(out).__name__}{first}"
        why = f"{what}, which is neither a tensor nor holds the logits"
    else:
        shown = ", ".join(f"{k!r}: {kind(v)}" for k, v in list(fields.items())[:8])
        what = f"a {type(out).__name__} {{{shown}{', ...' if len(fields) > 8 else ''}}}"
        several = sum(isinstance(v, torch.Tensor) for v in fields.values()) > 1
        why = (f"{what}: several tensors and none under the key 'logits', so autopar cannot tell which one "
               f"is the logits" if several else f"{what}, which holds no tensor")
    return ModelOutputError(
        f"the model returned {why}; autopar hands loss_fn(logits, targets) (and each pipeline stage the next) "
        f"one tensor, the logits",
        hint="return the logits tensor, or a dict / dataclass holding it under the key 'logits' (its other "
             "entries are ignored)")


@contextlib.contextmanager
def buffers_kept(model: nn.Module):
    """Restore the model's real buffers after a probe forward on fake tensors (enter it
    before FakeTensorMode, so that the copies are real):
    an in-place update in forward (BatchNorm's running statistics and
    `num_batches_tracked += 1`) writes through to the real tensor a fake op
    was given, and a probe must leave the model as it found it."""
    saved = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"
             and not isinstance(b, FakeTensor)]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


@contextlib.contextmanager
def probe_forward(model: nn.Module, fake: bool = True):
    """What every forward that only reads shapes (the output check, the block and
    pipeline probes) runs under: the model's buffers restored afterwards, no
    autograd, Hugging Face's value checks and autocast on meta answered as
    capture answers them, and with `fake` FakeTensorMode (real weights are
    never read) with capture's bf16 shape fallback and answers for value-sized
    ops (an eager expert loop's nonzero: capture/value_answers.py). `fake=False` for a caller
    that enters its own FakeTensorMode (tensor_parallel.probe_blocks)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopar.capture.dtype_fallback import Bf16ShapeFallback
    from autopar.capture.hf_masks import assume_unpadded_batches
    from autopar.capture.meta_autocast import autocast_is_a_no_op_on_meta
    from autopar.capture.value_answers import ValueAnswers

    with contextlib.ExitStack() as stack:
        stack.enter_context(buffers_kept(model))  # outermost: its copies must be real tensors
        if fake:
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(ValueAnswers())
            stack.enter_context(Bf16ShapeFallback())
        for ctx in (torch.no_grad(), assume_unpadded_batches(), autocast_is_a_no_op_on_meta()):
            stack.enter_context(ctx)
        yield


def fake_attempts(model: nn.Module) -> tuple[bool, ...]:
    """The `fake` values a shape-only probe tries, in order: a model whose weights are
    all on the meta device runs on meta tensors first (the same shapes, devices and ops
    as fake tensors of meta weights, without FakeTensorMode's slow dispatch), then, only
    if meta cannot run it (a value-sized op), on fake tensors; any other model on fake
    tensors alone. Only the last attempt's failure is an answer."""
    return (False, True) if all(p.is_meta for p in model.parameters()) else (True,)


def on_model_device(model: nn.Module, args: tuple) -> tuple:
    """`args` on the device of the model's weights: fake tensors keep each tensor's
    device, and a meta-built model (the CLI's, or one lowered before materialisation)
    meeting CPU inputs is a device mismatch, not a verdict on the model."""
    param = next(model.parameters(), None)
    if param is None:
        return tuple(args)
    return tuple(a.to(param.device) if isinstance(a, torch.Tensor) else a for a in args)


def check_output(model: nn.Module, example_inputs) -> None:
    """Refuse a model whose output `logits_of` cannot read before any plan,
    process group or step: one forward of one sample on fake tensors (no
    memory; weights are not touched), fed as lowering feeds it, so every
    rank refuses alike. A forward fake tensors cannot run says nothing about
    the output and is left to the lowering's own checks."""
    if example_inputs is None:  # what capture traces when the caller gives none
        from autopar.capture.auto_inputs import infer_example_inputs
        example_inputs = infer_example_inputs(model)
    try:
        split = positional_inputs(model, example_inputs)
        args = split(1)[0] if split is not None else example_inputs(1) if callable(example_inputs) \
            else example_inputs
        args = on_model_device(model, args if isinstance(args, (tuple, list)) else (args,))
        with probe_forward(model):
            out = model(*args, **forward_kwargs(model))
    except Exception:  # noqa: BLE001 - not a verdict on the output
        return
    if _logits_or_none(out) is None:
        raise _output_error(out)


_NEEDS_LOSS_FN = "e.g. loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())"


def resolve_loss_fn(model: nn.Module, loss_fn):
    """The user's loss_fn (token-weighed when it is a mean over the targets
    that are not -100, see `UserTokenMeanLoss`), or the loss the model
    computes for its own labels when autopar can reproduce it exactly
    (`own_token_loss`)."""
    if loss_fn is not None:
        if not callable(loss_fn):
            raise AutoparError(f"loss_fn must be callable as loss_fn(logits, targets), got {type(loss_fn).__name__}")
        return UserTokenMeanLoss(loss_fn) if is_mean_over_scored_targets(loss_fn) else loss_fn
    return own_token_loss(model)


def is_mean_over_scored_targets(loss_fn) -> bool:
    """Whether loss_fn(logits, targets) is a mean over the targets that are
    not -100 (F.cross_entropy's default ignore_index), tried on small random
    logits: the loss of a batch whose rows score 1, 4, 5 and 6 targets must be
    the count-weighted mean of its rows' losses, and not their plain mean.
    Such a loss averaged per micro-batch and per dp rank is a mean of means,
    not the one-process mean; autopar then weighs it by its targets."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 11, generator=g)
    targets = torch.randint(0, 11, (4, 6), generator=g)
    targets[0, :5] = -100
    targets[1, :2] = -100
    targets[3, 1] = -100
    try:
        with torch.no_grad():
            whole = float(loss_fn(logits, targets))
            rows = [float(loss_fn(logits[i:i + 1], targets[i:i + 1])) for i in range(4)]
    except Exception:  # noqa: BLE001 - a loss for other shapes: used as given
        return False
    counts = (targets != -100).sum(1).tolist()
    weighted = sum(c * r for c, r in zip(counts, rows)) / sum(counts)
    plain = sum(rows) / len(rows)
    close = lambda a, b: abs(a - b) <= 1e-5 * max(1.0, abs(b))  # noqa: E731
    return close(whole, weighted) and not close(whole, plain)


class TokenWeighedLoss:
    """A loss train_step weighs over the global batch's scored targets:
    before each step it sets `tokens_per_share` (the global count of scored
    targets over micro-batches x dp ranks, see ParallelModel._weigh_by_tokens)."""

    IGNORE_INDEX = -100  # transformers' and F.cross_entropy's default
    shift = False
    labels_shifted = False  # set while context parallelism hands a shifting loss pre-shifted labels

    def __init__(self):
        self.tokens_per_share: float | None = None  # None: the plain per-micro-batch mean

    def scored_tokens(self, labels: torch.Tensor) -> torch.Tensor:
        return ((labels[..., 1:] if self.shift else labels) != self.IGNORE_INDEX).sum()


class UserTokenMeanLoss(TokenWeighedLoss):
    """The user's mean-over-scored-targets loss, times this micro-batch's
    scored targets / tokens_per_share: the mean over every scored target of
    the global batch, as one process computes it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def __call__(self, logits, targets):
        loss = self.fn(logits, targets)
        if self.tokens_per_share is None:
            return loss
        n = self.scored_tokens(targets)
        if int(n) == 0:  # the mean over no targets is nan; this share adds nothing
            return (logits.sum() * 0.0).float()
        return loss * (n.to(torch.float32) / self.tokens_per_share)

    def __repr__(self) -> str:
        return f"UserTokenMeanLoss({getattr(self.fn, '__name__', self.fn)!r})"


def own_token_loss(model: nn.Module) -> "HFTokenLoss":
    """A Hugging Face model's own loss, as its forward computes it from `labels`.

    Reproduced exactly (value, gradient, and the mean over the global
    batch's scored tokens across micro-batches and dp ranks) for the two
    token cross-entropies transformers' models use:
      * causal LM: `self.loss_function` resolving to ForCausalLMLoss
        (labels shifted by one inside the loss);
      * masked LM and sequence-to-sequence: ForMaskedLMLoss, or the
        forward's own `CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))`
        in ...ForMaskedLM / ...ForConditionalGeneration (no shift: T5 and
        BART shift the labels into `decoder_input_ids`, not into the loss).
    Anything else (classification, regression, router auxiliary losses, a
    custom loss in forward) is refused rather than approximated: training
    a different objective silently is worse than asking for `loss_fn`."""
    name = type(model).__name__
    if not is_hf_model(model):
        raise AutoparError("autopar.compile needs loss_fn(logits, targets) returning the mean loss of a micro-batch",
                           hint=_NEEDS_LOSS_FN + "; Hugging Face language models may leave it out to use their own")
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if getattr(config, "output_router_logits", False):
        raise AutoparError(f"{name} adds a router load-balancing loss to its own loss (output_router_logits=True); "
                           f"autopar cannot reproduce it from the logits",
                           hint="pass loss_fn, or set config.output_router_logits=False")
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        source = ""
    kind, classes = None, vocab
    if "self.loss_function(" in source:
        fn_name = getattr(getattr(model, "loss_function", None), "__name__", "")
        kind = {"ForCausalLMLoss": "causal", "ForMaskedLMLoss": "tokens",
                "ForSequenceClassificationLoss": "classes"}.get(fn_name)
    elif name.endswith(("ForMaskedLM", "ForConditionalGeneration")) and (
            "CrossEntropyLoss(" in source or _plain_cross_entropy_attribute(model, source)):
        kind = "tokens"
    if kind == "classes":
        # ForSequenceClassificationLoss: cross-entropy over num_labels for
        # integer labels when num_labels > 1 (single-label); regression and
        # multi-label (MSE, BCE) are other objectives.
        classes = getattr(config, "num_labels", None)
        if getattr(config, "problem_type", None) not in (None, "single_label_classification") or not classes \
                or classes < 2:
            kind = None
    if kind is None or classes is None:
        raise AutoparError(
            f"{name} computes its own loss in a way autopar cannot reproduce exactly from its logits "
            f"(autopar reproduces causal-LM, masked-LM, seq2seq token and single-label classification "
            f"cross-entropy)",
            hint="pass loss_fn(logits, targets) returning the mean loss of a micro-batch; " + _NEEDS_LOSS_FN)
    return HFTokenLoss(int(classes), shift=kind == "causal",
                       fn=model.loss_function if kind == "causal" else None, integer_labels=kind == "classes")


def _plain_cross_entropy_attribute(model: nn.Module, forward_source: str) -> bool:
    """DistilBERT keeps `self.mlm_loss_fct = nn.CrossEntropyLoss()` and calls
    it in forward: the same loss when it has every default (mean over the
    labels that are not -100, no class weights, no smoothing)."""
    for attr, value in vars(model).get("_modules", {}).items():
        if isinstance(value, nn.CrossEntropyLoss) and f"self.{attr}(" in forward_source:
            return (value.weight is None and value.ignore_index == -100 and value.reduction == "mean"
                    and value.label_smoothing == 0.0)
    return False


class HFTokenLoss(TokenWeighedLoss):
    """A Hugging Face model's token cross-entropy, weighed over the global batch.

    A mean over each micro-batch's own tokens would weigh micro-batches
    (and dp ranks) with many ignored (-100) labels more than one big batch
    does. So, like transformers' Trainer, train_step sets `tokens_per_share`
    before each step: the global count of scored tokens divided by the
    number of shares the step averages over (micro-batches x dp ranks).
    Each micro-batch then returns sum / tokens_per_share, and the schedule's
    1/n and dp's average turn that into the mean over every scored token of
    the global batch: exactly `model(x, labels=y).loss` on the whole batch.
    `shift`: causal LMs score token t+1 from position t (labels shifted by
    one inside the loss); masked-LM and seq2seq losses score every position.
    """

    def __init__(self, vocab_size: int, *, shift: bool, fn=None, integer_labels: bool = False):
        super().__init__()
        self.vocab_size, self.shift, self.fn = vocab_size, shift, fn
        self.integer_labels = integer_labels  # classification: float labels would make it MSE / BCE

    def scored_tokens(self, labels: torch.Tensor) -> torch.Tensor:
        """Tokens the loss scores (causal: labels are shifted by one inside the loss)."""
        if self.integer_labels and labels.is_floating_point():
            raise AutoparError(
                f"the model's own classification loss is cross-entropy for integer class labels; float labels "
                f"({labels.dtype}) make transformers use MSE or BCE, which autopar does not reproduce",
                hint="pass integer class indices as targets, or pass loss_fn")
        return super().scored_tokens(labels)

    def __call__(self, logits, labels):
        if self.fn is not None:  # the model's own ForCausalLMLoss
            # under context parallelism the labels come shifted over the whole sequence
            given = {"labels": None, "shift_labels": labels} if self.labels_shifted else {"labels": labels}
            if self.tokens_per_share is None:
                return self.fn(logits=logits, vocab_size=self.vocab_size, **given)
            return self.fn(logits=logits, vocab_size=self.vocab_size, **given,
                           num_items_in_batch=torch.tensor(self.tokens_per_share, device=labels.device))
        flat, target = logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1).to(logits.device)
        if self.tokens_per_share is None:
            return nn.functional.cross_entropy(flat, target, ignore_index=self.IGNORE_INDEX)
        total = nn.functional.cross_entropy(flat, target, ignore_index=self.IGNORE_INDEX, reduction="sum")
        return total / self.tokens_per_share

    def __repr__(self) -> str:
        return f"HFTokenLoss(vocab_size={self.vocab_size}, shift={self.shift})"


def default_init_fn(model: nn.Module):
    """The model's own per-module init for meta models: an `_init_weights(module)`
    method, as Hugging Face models (weights, norms and RoPE buffers), nanoGPT and the
    GPT example write it and apply it in their constructor; None when there is none."""
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        return None
    if is_hf_model(model):
        return init
    try:
        params = [p for p in inspect.signature(init).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return None
    return init if len(params) == 1 else None
