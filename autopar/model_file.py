"""Load a model file that follows autopar's model-file convention.

A model file defines
    build_model() -> nn.Module
    example_inputs(batch_size: int) -> tuple
and may define more factories, selected as `path/to/file.py:factory`; a
factory returns `(model, example_inputs_fn)` or the model alone (then the
file's `example_inputs` is used). An optional `loss_fn(output, target)` is
picked up for `autopar compile`, and an optional `dataset()` (or
`dataset(model)`, given the model the factory built, e.g. to read its image
size) returning a torch Dataset of (inputs, targets) is what the emitted
train.py trains on when no --data is given. An optional `init_fn(module)`
(applied like nn.Module.apply, after each module's reset_parameters) lets
train.py build the parameters on the meta device and initialise only each
rank's shards; without it the model's own `_init_weights(module)` serves.
An optional `tokenizer()` (an object with `encode(str) -> list[int]`) is what
train.py tokenizes `--text` with when no --tokenizer is given.

A file that only builds the model (a Hugging Face `...ForCausalLM(config)`, a
nanoGPT `GPT(GPTConfig())`) needs no example_inputs for the common cases:
they are inferred from the model (autopar/capture/auto_inputs.py) and
`LoadedModel.inputs_note` says what was assumed, for the CLI to print.

The model is built under `torch.device("meta")` unless asked otherwise, so a
175B-parameter model costs no memory to load.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from autopar.capture.auto_inputs import infer_example_inputs
from autopar.errors import ModelFileError


CONSTRUCTOR_VALUES = "_autopar_constructor_values"  # module attribute: {parameter name: value}


@contextlib.contextmanager
def parameters_on_meta():
    """Every parameter a module registers goes to the meta device the moment it is
    registered (the constructor's own init then costs nothing); buffers stay real.
    A module without reset_parameters (an RMSNorm's `nn.Parameter(torch.ones(d))`)
    has no init to replay but its constructor's: those values are kept beside it,
    for autopar.lower.materialize to start that module's parameters from."""
    register = torch.nn.Module.register_parameter

    def to_meta(self, name, param):
        register(self, name, param)
        p = self._parameters.get(name)
        if p is not None and not p.is_meta:
            if not callable(getattr(self, "reset_parameters", None)):
                self.__dict__.setdefault(CONSTRUCTOR_VALUES, {})[name] = p.detach()
            self._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


@contextlib.contextmanager
def _meta_builds_on_cpu():
    """A factory that builds on the meta device itself (`with torch.device("meta"):
    return Llama(cfg)`, as planning without weights recommends) computes no values: an
    RMSNorm's `torch.ones(d)` and a RoPE table come out as meta, and nothing can fill them
    later. Under this mode (entered below the factory's own device context, which hands it
    each tensor it makes with device="meta") they are made on the CPU instead; then
    `parameters_on_meta` keeps each parameter's constructor value and moves it to meta, as
    for any model, and the buffers keep theirs (`keep_buffer_values`)."""
    from torch.overrides import TorchFunctionMode

    class MetaToCpu(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "meta":
                kwargs = {**kwargs, "device": "cpu"}
            return func(*args, **kwargs)

    with MetaToCpu():
        yield


def keep_buffer_values(model: torch.nn.Module) -> None:
    """Move a model's real buffers to meta, each carrying the value its constructor
    computed (`.autopar_value`): the model is then all meta for the lowering's probes
    (meta / fake tensors), and autopar.lower.materialize puts the values back. The stage modules'
    shallow views of the model share these tensors."""
    for sub in model.modules():
        for n, b in list(sub.named_buffers(recurse=False)):
            if not b.is_meta:
                meta = b.to("meta")
                meta.autopar_value = b
                sub._buffers[n] = meta


@dataclass
class LoadedModel:
    model: torch.nn.Module
    example_inputs: Callable[[int], tuple]
    loss_fn: Callable | None
    source: str  # "file.py:factory" as given
    name: str  # factory name, used in plan and report titles
    inputs_note: str | None = None  # set when example_inputs were inferred: what was assumed
    dataset: Callable | None = None  # the file's dataset() or dataset(model) -> torch Dataset, if any
    init_fn: Callable | None = None  # the file's init_fn(module): the model's init, module by module
    tokenizer: Callable | None = None  # the file's tokenizer() -> an object with encode(str), if any


def _prints_to_stderr():
    """Model code prints while it builds (nanoGPT: "number of parameters: ...");
    stdout belongs to autopar's output (`inspect --json`, `plan --json`)."""
    return contextlib.redirect_stdout(sys.stderr)


def split_spec(spec: str) -> tuple[str, str | None]:
    # A Windows drive letter ("C:\\x.py") is not a factory separator.
    path, sep, factory = spec.rpartition(":")
    if not sep or not path or os.sep in factory or factory.endswith(".py"):
        return spec, None
    return path, factory


def import_model_file(path: str):
    if not os.path.isfile(path):
        raise ModelFileError(f"model file not found: {path}",
                             hint="pass the path of a .py file that defines build_model() and example_inputs(batch_size)")
    name = "_autopar_model_" + os.path.splitext(os.path.basename(path))[0]
    # Its directory first on the path, as Python puts a script's: a model file importing its
    # neighbours (`from model import GPT`, as nanoGPT-style repositories do) imports them, also
    # later (a build_model that imports inside the function)
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up
    try:
        with _prints_to_stderr():
            module_spec.loader.exec_module(module)
    except ModuleNotFoundError as exc:  # a neighbour it imports is not beside it, nor installed
        raise ModelFileError(f"importing {path} failed: {type(exc).__name__}: {exc}",
                             hint=f"the file's own folder ({folder}) is searched first: put {exc.name!r} there, "
                                  f"install it, or add its folder to PYTHONPATH") from exc
    except Exception as exc:  # the user's file failed: say where, keep it short
        raise ModelFileError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def load_model(spec: str, device: str | torch.device = "meta", *, seq_len: int | None = None) -> LoadedModel:
    """Import the file, build the model (on `device`) and find its example inputs.

    device "meta-params": parameters built on the meta device and buffers real on the
    CPU (what the constructor computed: position ids, causal masks, RoPE tables), as
    accelerate's init_empty_weights(include_buffers=False) builds; the buffers then go
    to meta too, their values kept for lowering, which materialises only this rank's
    shards and puts the buffers back (autopar.lower.materialize).
    seq_len: the sequence length for inferred inputs (the CLI's --seq-len);
    a file's own example_inputs keep theirs.
    """
    path, factory_name = split_spec(spec)
    module = import_model_file(path)
    factory_name = factory_name or "build_model"
    factory = getattr(module, factory_name, None)
    if factory is None or not callable(factory):
        available = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
                           and not isinstance(v, type))
        raise ModelFileError(
            f"{path} has no function {factory_name}()",
            hint=("a model file defines build_model() -> nn.Module and example_inputs(batch_size) -> tuple; "
                  f"functions found in this file: {', '.join(available) or 'none'}"),
        )
    if device == "meta-params":
        ctx = contextlib.ExitStack()
        ctx.enter_context(_meta_builds_on_cpu())  # below a factory's own `with torch.device("meta")`
        ctx.enter_context(parameters_on_meta())
    else:
        ctx = torch.device(device) if device is not None else contextlib.nullcontext()
    try:
        with ctx, _prints_to_stderr():
            built = factory()
    except ModelFileError:
        raise
    except Exception as exc:
        raise ModelFileError(f"{path}:{factory_name}() raised {type(exc).__name__}: {exc}") from exc
    inputs_fn = None
    if isinstance(built, tuple):
        if len(built) != 2 or not isinstance(built[0], torch.nn.Module) or not callable(built[1]):
            raise ModelFileError(f"{path}:{factory_name}() must return a model or (model, example_inputs_fn)")
        built, inputs_fn = built
    if not isinstance(built, torch.nn.Module):
        raise ModelFileError(f"{path}:{factory_name}() returned {type(built).__name__}, not an nn.Module")
    if device == "meta-params":
        keep_buffer_values(built)
    inputs_fn = inputs_fn or getattr(module, "example_inputs", None)
    note = None
    if inputs_fn is None:
        inferred = infer_example_inputs(built, seq_len)
        if inferred is None:
            raise ModelFileError(
                f"{path} defines no example_inputs(batch_size), and they cannot be inferred for "
                f"{type(built).__name__}",
                hint="add `def example_inputs(batch_size): return (tensor, ...)` returning one batch of model "
                     "inputs (inferred only for Hugging Face models and modules whose first layer is an "
                     "nn.Embedding or nn.Conv2d)")
        inputs_fn, note = inferred, f"example inputs inferred: {inferred.description}"
    return LoadedModel(model=built, example_inputs=inputs_fn, loss_fn=getattr(module, "loss_fn", None),
                       source=spec, name=factory_name if factory_name != "build_model" else
                       os.path.splitext(os.path.basename(path))[0], inputs_note=note,
                       dataset=getattr(module, "dataset", None), init_fn=getattr(module, "init_fn", None),
                       tokenizer=getattr(module, "tokenizer", None))
