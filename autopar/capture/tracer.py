"""One instrumented forward + backward of a meta model at one (batch, seq) point.

How a run works:
- Module hooks keep the module stack and a *layer pointer* (0 = everything
  before the first block, i = block i, n+1 = everything after the last).
- A TorchDispatchMode records every aten op (forward and backward) with its
  shapes, FLOPs, bytes, module path, layer and the autograd node it belongs
  to, so backward ops map back to the forward op that created them.
- `saved_tensors_hooks` sees every tensor autograd saves for backward; it is
  attributed to the current layer (deduplicated by storage later).
- Block inputs are cut (detach + requires_grad) so each layer has its own
  autograd graph; after the forward, backward is run layer by layer from the
  layer's outputs, which attributes backward FLOPs exactly.
- Blocks identical to an already measured block (same static signature, same
  input shapes) are not run at all: their forward returns empty tensors shaped
  like the representative's outputs, and the representative's numbers are
  reused. That is what makes a 126-block model cost about one block.
"""
from __future__ import annotations

import linecache
import math
import os
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.capture import ops as opinfo
from autopar.capture.dtype_fallback import shapes_in_bf16
from autopar.capture.gpu_kernels import gpu_kernels
from autopar.capture.hf_masks import assume_unpadded_batches
from autopar.capture.meta_autocast import autocast_is_a_no_op_on_meta
from autopar.capture.no_checkpointing import checkpointing_off
from autopar.errors import CaptureError

aten = torch.ops.aten

# Ops whose result is a Python value computed from tensor data: on meta there
# is no data, so this is data-dependent control flow in the model.
_DATA_DEPENDENT = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.item}
_TORCH_DIR = os.path.dirname(torch.__file__)
_AUTOPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class OpRecord:
    idx: int
    op: str
    kind: str
    layer: int
    module: str
    phase: str  # "fwd" | "bwd"
    in_shapes: tuple
    in_dtypes: tuple
    out_shapes: tuple
    out_dtypes: tuple
    flops: int
    bytes_read: int
    bytes_written: int
    gemm: tuple | None
    seq_nr: int
    uses_param: bool
    param_names: tuple
    inputs: tuple  # indices of producing records (forward dataflow)
    out_is_int: bool
    # forward: the producing record of each tensor input, in in_shapes' order (-1: none
    # traced, a parameter or the layer's input), to tell a module's inner tensors from its inputs
    in_producers: tuple = ()
    fwd_ref: int | None = None  # backward op: index of the forward op it differentiates
    causal: bool | None = None  # attention kernels: is_causal
    # a GEMM an nn.Linear's own forward runs on its own (untied) weight: what torchao's
    # float8 training converts (convert_to_float8_training swaps the module)
    linear: bool = False
    # Forward layout ops (split, slice, transpose, permute...): their dimension
    # arguments by schema name, so tensor-parallel capture can follow which dim is sharded.
    dims: dict | None = None
    # An op whose cost depends on a mode argument: gelu's tanh approximation is several
    # times slower than its erf form on a CPU core (a measured profile times both).
    variant: str | None = None

    @property
    def nbytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass
class SavedRecord:
    layer: int
    storage: int
    nbytes: int
    producer: int | None
    shape: tuple
    origin: int | None = None  # forward op that first wrote this storage (views see through)
    # sequence number of the autograd node that saved it: autograd frees it once that
    # node's backward has run (the last of its savers', when several save one storage)
    saver_seq: int = -1


@dataclass
class PointTrace:
    batch: int
    seq: int | None
    records: list = field(default_factory=list)
    saved: list = field(default_factory=list)
    rep_of: dict = field(default_factory=dict)  # layer -> measured layer with the same numbers
    input_bytes: dict = field(default_factory=dict)
    output_bytes: dict = field(default_factory=dict)
    input_shapes: dict = field(default_factory=dict)  # layer -> shapes of its tensor inputs
    called: dict = field(default_factory=dict)  # layer -> module paths called there (outside blocks)
    params_used: dict = field(default_factory=dict)  # layer -> set of parameter names
    topk: dict = field(default_factory=dict)  # layer -> (experts, k)
    own_checkpointing: bool = False  # the model called torch.utils.checkpoint (run plainly)
    param_bytes: dict = field(default_factory=dict)  # parameter name -> bytes


_DIM_NAMES = ("dim", "dim0", "dim1", "dims", "source", "destination")


def _dim_args(func, args, kwargs) -> dict | None:
    """The op's dimension arguments ({'dim': 2}, {'dims': (0, 2, 1, 3)}), defaults filled in."""
    found = None
    for i, arg in enumerate(func._schema.arguments):
        if arg.name not in _DIM_NAMES:
            continue
        if i < len(args):
            value = args[i]
        elif arg.name in kwargs:
            value = kwargs[arg.name]
        elif arg.has_default_value():
            value = arg.default_value
        else:
            continue
        if isinstance(value, (list, tuple)):
            value = tuple(int(v) for v in value) if all(isinstance(v, int) for v in value) else None
        elif not isinstance(value, int) or isinstance(value, bool):
            value = None
        if value is not None:
            found = found or {}
            found[arg.name] = value
    return found


def _is_causal(func, args, kwargs) -> bool:
    """An attention kernel's `is_causal` argument, found by name: the flash and
    memory-efficient kernels take it at different positions."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "is_causal":
            value = args[i] if i < len(args) else kwargs.get("is_causal", arg.default_value)
            return bool(value)
    return False


class _CaptureAbort(Exception):
    """Raised inside the model's forward; turned into CaptureError at the top."""

    def __init__(self, error: CaptureError):
        super().__init__(error.message)
        self.error = error


def _user_frame(tb_frames=None) -> str:
    """`file:line: code` of the innermost frame in the user's code (not torch, not autopar)."""
    frames = tb_frames if tb_frames is not None else traceback.extract_stack()
    for frame in reversed(frames):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TORCH_DIR) or path.startswith(_AUTOPAR_DIR) or "<frozen" in path:
            continue
        code = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        return f"{frame.filename}:{frame.lineno}: {code}"
    return "unknown location"


def _writable(leaf: torch.Tensor) -> torch.Tensor:
    """A non-leaf alias of a cut: user code may add into a layer's output in place
    (`y = self.o(a); y += h`), which autograd refuses on a leaf. The copy is made
    outside the recorder (no op is priced) and its backward passes the gradient
    straight to the leaf."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        return leaf.clone()


class _Recorder(TorchDispatchMode):
    def __init__(self, tracer: "Tracer"):
        super().__init__()
        self.tracer = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        if tracer.fabricating:
            return func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _DATA_DEPENDENT:
            if tracer.expert_index(packet, args):
                return 0
            raise _CaptureAbort(tracer.data_dependent_error(func))
        if packet is aten.nonzero or packet is aten.argwhere:
            out = tracer.balanced_nonzero(func, args[0])
        else:
            try:
                out = func(*args, **kwargs)
            except _CaptureAbort:
                raise
            except Exception as exc:
                out = shapes_in_bf16(func, args, kwargs)
                if out is None:
                    raise _CaptureAbort(tracer.op_error(func, exc)) from None
        tracer.record(func, args, kwargs, out)
        return out


class Tracer:
    """Instruments one meta model; `run(batch, seq, args, kwargs)` -> PointTrace."""

    def __init__(self, model: nn.Module, blocks: list, block_signatures: list, loss_fn=None):
        self.model = model
        self.loss_fn = loss_fn
        self.blocks = blocks
        self.n_layers = len(blocks) + 2  # pre, blocks..., post
        self.block_layer = {id(m): i + 1 for i, (_, m) in enumerate(blocks)}
        self.block_sig = {i + 1: sig for i, sig in enumerate(block_signatures)}
        self.paths = {}
        for path, module in model.named_modules():
            self.paths.setdefault(id(module), path)
        block_paths = [p for p, _ in blocks]
        # Modules that are a block, inside one, or contain one are not "pre/post" modules.
        self.grouping = {}
        for path, module in model.named_modules():
            inside = any(path == b or path.startswith(b + ".") or b == "" for b in block_paths)
            contains = any(b.startswith(path + ".") or path == "" for b in block_paths)
            self.grouping[id(module)] = not (inside or contains)
        self.param_storage = {}
        self.param_bytes = {}  # name -> bytes (the size of its gradient)
        for name, p in model.named_parameters():
            self.param_storage.setdefault(p.untyped_storage()._cdata, name)
            self.param_bytes[name] = p.numel() * p.element_size()
        self.state_storage = set(self.param_storage) | {b.untyped_storage()._cdata for b in model.buffers()}
        # nn.Linear modules whose weight is their own (a weight tied to an embedding is
        # another module's parameter first: converting it would untie the two)
        self.linear_weights = {
            path: f"{path}.weight" if path else "weight" for path, m in model.named_modules()
            if isinstance(m, nn.Linear) and self.param_storage.get(m.weight.untyped_storage()._cdata)
            == (f"{path}.weight" if path else "weight")}
        self._install()

    # -- hooks ---------------------------------------------------------------
    def _install(self):
        for module in self.model.modules():
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave, always_call=True)
        for i, (_, block) in enumerate(self.blocks):
            block.register_forward_pre_hook(self._block_enter, with_kwargs=True, prepend=True)
            block.register_forward_hook(self._block_leave)
            original = block.forward
            layer = i + 1

            def forward(*args, _original=original, _layer=layer, **kwargs):
                rep = self.shortcut.get(_layer)
                if rep is not None:
                    return self._fabricate(rep)
                return _original(*args, **kwargs)

            block.forward = forward

    def _enter(self, module, args):
        path = self.paths.get(id(module), "?")
        self.module_stack.append(path)
        if self.grouping.get(id(module)) and path:
            self.trace.called.setdefault(self.pointer, []).append(path)

    def _leave(self, module, args, output):
        if self.module_stack:
            self.module_stack.pop()

    def _block_enter(self, module, args, kwargs):
        layer = self.block_layer[id(module)]
        flat, spec = tree_flatten((args, kwargs))
        new_flat = []
        in_bytes, storages, shapes = 0, set(), []
        for x in flat:
            if isinstance(x, torch.Tensor):
                shapes.append((tuple(x.shape), str(x.dtype)))
                key = x.untyped_storage()._cdata
                if key not in self.state_storage and key not in storages:
                    storages.add(key)
                    in_bytes += x.untyped_storage().nbytes()
                if x.requires_grad and x.grad_fn is not None:
                    x = self._cut(x)
            else:
                shapes.append(repr(x) if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__)
            new_flat.append(x)
        self.trace.input_bytes[layer] = in_bytes
        self.trace.input_shapes[layer] = tuple(shapes)
        self.pointer = layer
        rep = self.reps.setdefault((self.block_sig[layer], tuple(shapes)), layer)
        self.trace.rep_of[layer] = rep
        if rep != layer:
            self.shortcut[layer] = rep
        args, kwargs = tree_unflatten(new_flat, spec)
        return args, kwargs

    def _block_leave(self, module, args, output):
        layer = self.block_layer[id(module)]
        flat, spec = tree_flatten(output)
        if layer not in self.shortcut:
            self.out_specs[layer] = (spec, [(tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor)
                                            else ("value", t) for t in flat])
        self.trace.output_bytes[layer] = sum(opinfo.tensor_bytes(t) for t in flat if isinstance(t, torch.Tensor))
        if layer == self.n_layers - 2:  # last block: cut its outputs from the head
            for t in flat:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    self.seg_outputs.setdefault(layer, []).append(t)
            flat = [self._writable(self._cut(t, layer)) if isinstance(t, torch.Tensor) and t.requires_grad else t
                    for t in flat]
            self.pointer = self.n_layers - 1
            return tree_unflatten(flat, spec)
        return output

    def _cut(self, x: torch.Tensor, producer_layer: int | None = None) -> torch.Tensor:
        leaf = self.cuts.get(id(x))
        if leaf is None:
            if producer_layer is None:
                rec = self.producer.get(id(x))
                producer_layer = self.trace.records[rec].layer if rec is not None and rec >= 0 else self.pointer
                self.seg_outputs.setdefault(producer_layer, []).append(x)
            leaf = x.detach().requires_grad_()
            self.cuts[id(x)] = leaf
            self.keep.extend((x, leaf))
            if id(x) in self.producer:
                self.producer[id(leaf)] = self.producer[id(x)]
        return leaf

    def _writable(self, leaf: torch.Tensor) -> torch.Tensor:
        """`_writable(leaf)`, standing for the leaf in the op graph (same producer)."""
        alias = _writable(leaf)
        self.keep.extend((leaf, alias))
        if id(leaf) in self.producer:
            self.producer[id(alias)] = self.producer[id(leaf)]
        return alias

    def _fabricate(self, rep: int):
        spec, leaves = self.out_specs[rep]
        flat = []
        self.fabricating = True
        for leaf in leaves:
            if leaf[0] == "value":
                flat.append(leaf[1])
            else:
                shape, dtype, requires_grad = leaf
                t = torch.empty(shape, dtype=dtype, device="meta", requires_grad=requires_grad)
                flat.append(self._writable(t) if requires_grad else t)
        self.fabricating = False
        return tree_unflatten(flat, spec)

    def _pack(self, t: torch.Tensor):
        if self.phase == "fwd":
            key = t.untyped_storage()._cdata
            if key not in self.state_storage:
                # packed while the saving op's node is the newest one made
                self.trace.saved.append(SavedRecord(self.pointer, key, t.untyped_storage().nbytes(),
                                                    self.producer.get(id(t)), tuple(t.shape),
                                                    self.storage_origin.get(key),
                                                    torch.autograd._get_sequence_nr() - 1))
        return t

    # -- op recording ----------------------------------------------------------
    def record(self, func, args, kwargs, out):
        in_flat = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        out_flat = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        trace = self.trace
        idx = len(trace.records)
        params = []
        for x in in_flat:
            name = self.param_storage.get(x.untyped_storage()._cdata)
            if name is not None:
                params.append(name)
        if self.phase == "fwd":
            seq_nr = torch.autograd._get_sequence_nr() - 1
            inputs = tuple(self.producer[id(x)] for x in in_flat if id(x) in self.producer)
            in_producers = tuple(self.producer.get(id(x), -1) for x in in_flat)
        else:
            node = torch._C._current_autograd_node()
            seq_nr = node._sequence_nr() if node is not None else -1
            inputs = in_producers = ()
        moves = not opinfo.moves_no_data(func)
        read = sum(opinfo.tensor_bytes(x) for x in in_flat) if moves else 0
        written = sum(opinfo.tensor_bytes(x) for x in out_flat) if moves else 0
        packet = func._overloadpacket
        rec = OpRecord(
            idx=idx, op=str(packet), kind=opinfo.op_kind(packet), layer=self.pointer,
            module=self.module_stack[-1] if self.module_stack else "",
            phase=self.phase, in_shapes=tuple(tuple(x.shape) for x in in_flat),
            in_dtypes=tuple(str(x.dtype).removeprefix("torch.") for x in in_flat),
            out_shapes=tuple(tuple(x.shape) for x in out_flat),
            out_dtypes=tuple(str(x.dtype).removeprefix("torch.") for x in out_flat),
            flops=opinfo.flops_of(func, args, kwargs, out), bytes_read=read, bytes_written=written,
            gemm=opinfo.gemm_shape(func, args, out_flat[0]) if self.phase == "fwd" and out_flat
            and opinfo.op_kind(packet) == "gemm" else None,
            seq_nr=seq_nr, uses_param=bool(params), param_names=tuple(params), inputs=inputs,
            in_producers=in_producers, out_is_int=bool(out_flat) and not (out_flat[0].is_floating_point() or out_flat[0].is_complex()),
        )
        if self.phase == "fwd":
            rec.dims = _dim_args(func, args, kwargs)
            rec.linear = rec.kind == "gemm" and self.linear_weights.get(rec.module) in params
            if packet is aten.gelu and kwargs.get("approximate", "none") != "none":
                rec.variant = kwargs["approximate"]
        if rec.kind == "attention" and self.phase == "fwd":
            rec.causal = _is_causal(func, args, kwargs)
        if self.phase == "fwd":
            if rec.kind == "attention":
                # Inside a custom autograd Function (grouped-query flash) every op
                # shares the Function's node: its backward differentiates the kernel.
                self.seq_to_fwd[(self.pointer, seq_nr)] = idx
            else:
                self.seq_to_fwd.setdefault((self.pointer, seq_nr), idx)
            for x in out_flat:
                self.producer[id(x)] = idx
                self.storage_origin.setdefault(x.untyped_storage()._cdata, idx)
            self.keep.extend(out_flat)
            if packet is aten.topk:
                k = args[1] if len(args) > 1 else kwargs.get("k")
                trace.topk[self.pointer] = (args[0].shape[-1], int(k), math.prod(args[0].shape[:-1]))
            if params:
                trace.params_used.setdefault(self.pointer, set()).update(params)
        else:
            rec.fwd_ref = self.seq_to_fwd.get((self.pointer, seq_nr))
            if rec.fwd_ref is not None:
                rec.module = trace.records[rec.fwd_ref].module
        trace.records.append(rec)

    def balanced_nonzero(self, func, mask: torch.Tensor) -> torch.Tensor:
        """nonzero() has a data-dependent size. Inside a layer that ran top-k
        routing it is the token list of one expert: assume balanced routing,
        rows * k / experts tokens. Anywhere else it cannot be sized: error."""
        routing = self.trace.topk.get(self.pointer)
        if routing is None:
            raise _CaptureAbort(CaptureError(
                f"module {self._where()}: {func} has a data-dependent output size at {_user_frame()}",
                hint="capture runs on the meta device (no values); write it with fixed shapes "
                     "(a boolean mask multiplied in, torch.where(cond, a, b), or a fixed capacity) "
                     "or use it only inside a top-k routed MoE layer, where balanced routing is assumed"))
        experts, k, rows = routing
        # A mask over the experts (which were hit; DBRX's one_hot has experts + 1 classes)
        # holds every expert, one over the tokens the balanced share of the assignments.
        count = min(mask.numel(), experts if mask.numel() <= experts + 1 else (rows * k) // experts)
        return torch.empty((count, mask.dim()), dtype=torch.long, device="meta")

    def expert_index(self, packet, args) -> bool:
        """An integer read back inside a top-k routed layer: the loop over the
        experts that were hit (DBRX's `for e in hit: mask[e[0]]`) indexes an
        expert with it. Experts are alike in shape and the token lists are
        sized as balanced routing, so answering expert 0 prices every
        iteration as any expert would."""
        return (packet is aten._local_scalar_dense and bool(self.trace.topk.get(self.pointer))
                and isinstance(args[0], torch.Tensor) and args[0].numel() == 1
                and not args[0].dtype.is_floating_point and args[0].dtype is not torch.bool)

    def _where(self) -> str:
        return self.module_stack[-1] if self.module_stack and self.module_stack[-1] else "<root>"

    def data_dependent_error(self, func) -> CaptureError:
        hint = ("capture traces on the meta device, where tensors have shapes but no values; "
                "replace Python branching on tensor values with tensor ops (torch.where, masking, "
                "clamp) or move the check out of forward()")
        if self.trace.topk.get(self.pointer):
            # The usual MoE loop: `for e in hit_experts: if e == ...` reads which experts were hit.
            hint = ("this layer routes tokens with top-k; a loop over the experts that were hit reads "
                    "routing values. Loop over range(num_experts) and index with torch.where(mask) "
                    "(sized as balanced routing), or run the experts as one grouped GEMM (Hugging Face: "
                    "keep the default experts_implementation, not 'eager'). ") + hint
        return CaptureError(
            f"module {self._where()}: data-dependent control flow on a tensor value ({func}) at {_user_frame()}",
            hint=hint)

    def op_error(self, func, exc: Exception) -> CaptureError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "nonzero" in str(exc) or "data-dependent" in str(exc) or "DynamicOutputShape" in type(exc).__name__:
            return CaptureError(
                f"module {self._where()}: op {func} has a data-dependent output size (boolean-mask indexing, "
                f"nonzero, unique...) at {_user_frame()}",
                hint="capture runs on the meta device (no values); use fixed shapes instead: multiply by the "
                     "mask, torch.where(cond, a, b), or a fixed capacity")
        if isinstance(exc, NotImplementedError) or "Meta" in str(exc) or "meta" in first or "fake impl" in str(exc):
            return CaptureError(
                f"module {self._where()}: op {func} cannot run on the meta device ({first}) at {_user_frame()}",
                hint="register a meta/fake implementation for it (torch.library.register_fake) or "
                     "replace it with standard torch ops")
        return CaptureError(f"module {self._where()}: op {func} failed: {type(exc).__name__}: {first} "
                            f"at {_user_frame()}",
                            hint="check that example_inputs(batch_size) returns inputs of the right "
                                 "shapes and dtypes for this model")

    def _loss(self, output):
        """loss_fn(output, targets) as part of the head layer; targets are class
        indices shaped like the output without its last (class) dim."""
        self.pointer = self.n_layers - 1
        if isinstance(output, dict) and isinstance(output.get("logits"), torch.Tensor):
            output = output["logits"]  # the lowering's loss reads a dict output's "logits" too (model_io.logits_of)
        # a tensor, a tuple led by the logits, or a Hugging Face output's `.logits`
        logits = output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)
        self.fabricating = True  # not an op of the model
        targets = torch.zeros(logits.shape[:-1], dtype=torch.long, device="meta")
        self.fabricating = False
        self.producer[id(targets)] = -1
        self.keep.append(targets)
        self.module_stack.append("loss")
        try:
            return self.loss_fn(output, targets)
        finally:
            self.module_stack.pop()

    # -- one run -------------------------------------------------------------
    def run(self, batch: int, seq: int | None, args: tuple, kwargs: dict) -> PointTrace:
        self.trace = PointTrace(batch, seq, param_bytes=self.param_bytes)
        self.module_stack, self.pointer, self.phase, self.fabricating = [], 0, "fwd", False
        self.reps, self.shortcut, self.out_specs = {}, {}, {}
        self.cuts, self.producer, self.keep, self.seg_outputs, self.seq_to_fwd = {}, {}, [], {}, {}
        self.storage_origin = {}
        for p in self.model.parameters():  # no accumulation into last run's .grad
            p.grad = None
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                self.producer[id(x)] = -1  # "model input" in the dataflow
                self.keep.append(x)
        try:
            with checkpointing_off() as checkpointing, \
                    torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), \
                    gpu_kernels(), assume_unpadded_batches(), autocast_is_a_no_op_on_meta(), _Recorder(self), \
                    torch.enable_grad():
                output = self.model(*args, **kwargs)
                post = self.n_layers - 1
                if self.loss_fn is not None:
                    output = self._loss(output)
                outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
                self.trace.output_bytes[post] = sum(opinfo.tensor_bytes(t) for t in outs)
                self.seg_outputs.setdefault(post, []).extend(t for t in outs if t.requires_grad)
                self.phase = "bwd"
                self.module_stack = []
                for layer in sorted(self.seg_outputs, reverse=True):
                    roots = [t for t in self.seg_outputs[layer] if t.grad_fn is not None]
                    if not roots or layer in self.shortcut:
                        continue
                    self.pointer = layer
                    # retain_graph: a tensor reused across layers (a skip connection
                    # around a block) must not free a graph another layer walks.
                    torch.autograd.backward(roots, [torch.empty_like(t) for t in roots], retain_graph=True)
        except _CaptureAbort as abort:
            raise abort.error from None
        except CaptureError:
            raise
        except Exception as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CaptureError(
                f"module {self._where()}: {type(exc).__name__}: {first} at {_user_frame(frames)}",
                hint="the model's forward failed on meta tensors of the example inputs' shapes; "
                     "check example_inputs(batch_size) and that forward() uses no tensor values") from None
        finally:
            self.keep = []
        self.trace.own_checkpointing = checkpointing.used
        for layer in range(self.n_layers):
            self.trace.rep_of.setdefault(layer, layer)
        # Only layer 0's pre-hook never runs: its input is the model's input.
        self.trace.input_bytes.setdefault(0, sum(
            opinfo.tensor_bytes(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)))
        self.trace.output_bytes.setdefault(0, sum(opinfo.tensor_bytes(t) for t in self.seg_outputs.get(0, [])))
        self.trace.input_bytes.setdefault(self.n_layers - 1, self.trace.output_bytes.get(self.n_layers - 2, 0))
        return self.trace
