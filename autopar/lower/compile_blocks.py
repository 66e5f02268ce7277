"""Regional compilation: each block of the plan runs as torch.compile'd code (issue 31).

Where and in which order, as torchtitan does it (`torchtitan/models/llama3/parallelize.py`,
`torchtitan/distributed/compile.py: apply_compile`): tensor parallelism, then activation
checkpointing, then `block.compile(fullgraph=True)` on each block, then FSDP2. So dynamo
traces the block with its DTensor parameters and tp hooks, and the checkpoint (full or
selective) becomes part of the compiled forward and backward; FSDP2's all-gather and
reduce-scatter hooks, added after, stay outside the compiled graph (they are
`_dynamo_disable`d). Embeddings and the head run eager, as in torchtitan.

`nn.Module.compile` compiles the module's call in place (`_compiled_call_impl`): no
wrapper module, so module paths, parameter names, FSDP units and snapshots are the
same as without compilation. Blocks of one class and shapes share one compiled code:
dynamo keys its cache on the code object and inlines nn modules (parameters are graph
inputs), so a stack of 32 blocks compiles once. Blocks that differ add an entry:
under sequence parallelism the first block's scatter and the last block's gather
hooks recompile once each, and the first block's forward once more (its input is
a DTensor whose local tensor does not require a gradient).

A block that does not compile runs eager, alone: its first compiled call is a trial
(`_Trial`); any exception there (a graph break, which fullgraph turns into an error,
or a backend failure: the backward is compiled with the forward on that call, so a
backward that cannot compile fails here too) makes that block eager, and the reason
is recorded. Dynamo traces and compiles before it runs anything, so the eager call
that follows starts from the same state; a failure while the compiled code runs
(seen: tp with full checkpointing, in AOTAutograd's saving for backward) comes after
the block's forward ran, collectives included, on every tp rank alike (they run the
same code), and the eager call redoes it. After the first training step the ranks share what fell
back (`agree`, one all_gather_object, the same point on every rank), every rank runs
those blocks eager from then on, and the reasons go into `ParallelModel.notes` and,
on rank 0, the start-up log: no rank raises while the others wait.
"""
from __future__ import annotations

import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from autopar.errors import AutoparError

CHOICES = (True, False, "auto")


def check(torch_compile) -> None:
    if not any(torch_compile is c or (isinstance(c, str) and torch_compile == c) for c in CHOICES):
        raise AutoparError(f"torch_compile must be True, False or 'auto', not {torch_compile!r}")


def wanted(torch_compile, device: torch.device) -> bool:
    """torch_compile=True|False|"auto" (Hugging Face's TrainingArguments name);
    "auto": compiled on CUDA devices, eager elsewhere (inductor's CPU code pays a
    C++ compile per block kind, seconds that a CPU test run does not win back)."""
    check(torch_compile)
    return device.type == "cuda" if torch_compile == "auto" else bool(torch_compile)


def priced_otherwise(plan, compiling: bool) -> list[str]:
    """A sentence when the plan was priced with its blocks compiled and they run eager,
    or the other way round (`autopar plan --compile`, Plan.assumptions["engine"])."""
    from autopar.engine import plan_engine
    priced = plan_engine(plan).compiled_blocks
    if priced == compiling:
        return []
    return [f"the plan was priced with its blocks {'compiled' if priced else 'eager'}, and they run "
            f"{'compiled' if compiling else 'eager'} (torch_compile): expect the step time to differ from "
            f"the plan's; re-plan {'without' if priced else 'with'} --compile to price what runs"]


class CompiledBlocks:
    """The blocks this rank compiled, and those that fell back to eager (path -> reason)."""

    def __init__(self, backend: str, mode: str | None, own_cache: bool = False):
        self.backend, self.mode = backend, mode
        # tp collectives inside blocks, other ranks on other tp groups: inductor's shared caches off
        self.own_cache = own_cache and backend == "inductor"
        self.modules: dict[str, list[nn.Module]] = {}  # block path -> its module in each local stage view
        self.fell_back: dict[str, str] = {}
        self.agreed = False

    def apply(self, stages, layout) -> None:
        """Compile every local block (after tp and checkpointing, before FSDP2)."""
        kwargs = {"backend": self.backend, "fullgraph": True}
        if self.own_cache:  # one backend object for all blocks: dynamo guards on the backend's identity
            kwargs["backend"] = _InductorOwnCache(self.mode)
        elif self.mode is not None:
            kwargs["mode"] = self.mode
        for s in stages:
            for l in layout.layers_of_stage(s.stage_index):
                if l.position != "block" or len(l.paths) != 1:
                    continue
                module = s.model.get_submodule(l.paths[0])  # the checkpoint wrapper when recomputed
                module.register_forward_pre_hook(_settle_collectives, with_kwargs=True, prepend=True)
                module.compile(**kwargs)
                module._compiled_call_impl = _Trial(self, l.paths[0], module, module._compiled_call_impl)
                self.modules.setdefault(l.paths[0], []).append(module)

    def fall_back(self, path: str, reason: str) -> None:
        self.fell_back.setdefault(path, reason)
        for m in self.modules.get(path, ()):
            m._compiled_call_impl = None  # nn.Module.__call__ runs the eager _call_impl

    def compiled_paths(self) -> list[str]:
        return [p for p in self.modules if p not in self.fell_back]

    def start_note(self) -> str:
        paths = list(self.modules)
        mode = f", mode {self.mode}" if self.mode else ""
        cache = ("; inductor's on-disk caches not used (torch 2.13 serves one tp group's compiled collectives to "
                 "ranks of another)") if self.own_cache else ""
        return (f"torch.compile (backend {self.backend}{mode}, fullgraph) on this rank's {len(paths)} block(s) "
                f"({_span(paths)}), one compiled code per block signature; embeddings and head run eager{cache}")

    def agree(self) -> list[str]:
        """After the first training step: the union of every rank's fallbacks, run
        eager on every rank; one sentence per block that fell back. Collective."""
        self.agreed = True
        mine = dict(self.fell_back)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        union: dict[str, str] = {}
        for part in everyone:
            for path, reason in part.items():
                union.setdefault(path, reason)
        for path, reason in union.items():
            self.fall_back(path, reason)
        return [f"block {path} runs eager: torch.compile failed on it ({reason})"
                for path, reason in sorted(union.items(), key=lambda kv: _natural(kv[0]))]


class _InductorOwnCache:
    """Inductor without its on-disk FX graph and AOTAutograd caches, for blocks that issue
    tp collectives when other ranks of this machine sit on other tp groups (pp or dp > 1).
    Measured on torch 2.13 (CPU, pp 2 x tp 2, Llama): the cache key does not tell the tp
    groups apart, so ranks of the second stage loaded the first stage's compiled block,
    whose collectives name the first stage's group ("Could not resolve the process group
    registered under the name 7"); with the caches off all four ranks match eager. The
    backward is compiled with the forward so that it too is compiled under this patch."""

    def __init__(self, mode: str | None):
        self.mode = mode

    def __call__(self, gm, example_inputs):
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx
        with torch._functorch.config.patch(enable_autograd_cache=False, force_non_lazy_backward_lowering=True), \
                torch._inductor.config.patch(fx_graph_cache=False):
            return compile_fx(gm, example_inputs, config_patches=list_mode_options(self.mode) if self.mode else None)


@torch._dynamo.disable
def _settle_collectives(module, args, kwargs):
    """Block arguments that are pending collective results (AsyncCollectiveTensor: the
    output of an eager vocab-parallel embedding's all-reduce) become plain tensors
    before dynamo sees them. Measured on torch 2.13: a compiled frame taking one that
    requires a gradient returns outputs that do not (x.requires_grad == False in the
    block's guards), so the embedding got no gradient and training silently diverged.
    Any non-view op waits and unwraps; clone keeps the autograd edge (one activation copy)."""
    if not any(isinstance(a, AsyncCollectiveTensor) for a in (*args, *kwargs.values())):
        return None

    def settle(a):
        return a.clone() if isinstance(a, AsyncCollectiveTensor) else a
    return tuple(settle(a) for a in args), {k: settle(v) for k, v in kwargs.items()}


class _Trial:
    """A block's compiled call until it has run once with gradients; an exception
    on that call (trace, compile of forward and backward, or run) makes the block
    eager and is recorded; later calls go straight to the compiled code."""

    def __init__(self, owner: CompiledBlocks, path: str, module: nn.Module, compiled):
        self.owner, self.path, self.module, self.compiled = owner, path, module, compiled

    def __call__(self, *args, **kwargs):
        try:
            # The backward graph is compiled now, not at the first backward, so a
            # backward that cannot compile is found while eager can still take over.
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                out = self.compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure: this block runs eager, named
            self.owner.fall_back(self.path, reason(exc))
            return self.module._call_impl(*args, **kwargs)
        if torch.is_grad_enabled():
            self.module._compiled_call_impl = self.compiled  # proven: no trial on later calls
        return out


def reason(exc: BaseException) -> str:
    """A compile failure in one line: its first line, dynamo's "Explanation:" (which
    builtin or op broke the graph), and the user-code line it names ("from user
    code: File ..., line N" + the source line), else where the exception was raised."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    first = _clip(lines[0] if lines else "")
    why = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Explanation:")), "")
    at = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if at:
        i = at[-1]
        source = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("Set TORCH") else ""
        where = f"at {lines[i]}" + (f": {source}" if source else "")
    elif exc.__traceback__ is not None:
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"raised in {last.filename}:{last.lineno}"
    else:
        where = ""
    return "; ".join(x for x in (f"{type(exc).__name__}: {first}", _clip(why), where) if x)


def _clip(text: str) -> str:
    return text if len(text) <= 240 else text[:200] + " ... " + text[-30:]  # some assertions print type lists


def _natural(path: str):
    return [int(p) if p.isdigit() else p for p in path.split(".")]


def _span(paths: list[str]) -> str:
    paths = sorted(paths, key=_natural)
    if len(paths) <= 3:
        return ", ".join(paths)
    return f"{paths[0]} ... {paths[-1]}"
