"""Options shared by `autopar plan`, `autopar report` and `autopar compile`:
the model file, the cluster, the workload and the pinning flags, and the one
function that turns them into a Plan (plus the captured ModelGraph).
"""
from __future__ import annotations

import argparse
import os
import sys

from autopar.errors import AutoparError, ClusterSpecError
from autopar.plan import PRECISIONS

DEFAULT_DEVICE = "h100-sxm"


def add_plan_arguments(parser: argparse.ArgumentParser, *, model_required: bool = True, engine: bool = True) -> None:
    """The shared plan options. model_required=False (report/compile with
    --plan) makes the model positional optional; the command then checks
    that it has either a model or a saved plan. engine=False (compile) leaves
    out the flags that price another training engine: autopar lowers only its own."""
    parser.add_argument("model", nargs="?", default=None,
                        help="model file following the model-file convention, as path.py[:factory]"
                             + ("" if model_required else " (optional with --plan)") + "; or --model-size")
    parser.set_defaults(model_required=model_required)
    size = parser.add_argument_group("a standard decoder instead of a model file")
    size.add_argument("--model-size", "--model_size", dest="model_size", default=None, metavar="SIZE",
                      help="build a decoder of this many parameters (125M, 6B, 1.3B, 70B) and plan it as a model "
                           "file (autopar/zoo/sized.py; the shape chosen is printed)")
    size.add_argument("--family", default="gpt3", choices=("gpt3", "llama3"),
                      help="its shape family: GPT-3 (learned positions, LayerNorm, GELU) or Llama 3 (RoPE, "
                           "RMSNorm, SwiGLU, grouped-query attention); default gpt3")
    cl = parser.add_argument_group("cluster")
    cl.add_argument("--gpus", "--num_gpus", dest="gpus", type=int, default=None, metavar="N",
                    help="total GPU count (default: one node of the device or the --cluster file's size)")
    cl.add_argument("--gpus-per-node", type=int, default=None, metavar="G", help="GPUs per node (default: 8)")
    cl.add_argument("--device", default=None, metavar="NAME",
                    help=f"device profile or cluster preset, e.g. a100-80g, h100-sxm, dgx-h100 (default: {DEFAULT_DEVICE})")
    cl.add_argument("--cluster", default=None, metavar="FILE", help="cluster YAML/JSON file (devices, links, nodes)")
    cl.add_argument("--profile", default=None, metavar="FILE",
                    help="measured profile from `autopar calibrate`: price with that machine's timings "
                         "(its device and links replace the cluster's; node counts are kept)")
    wl = parser.add_argument_group("workload")
    wl.add_argument("--batch-size", type=int, default=None, metavar="B",
                    help="global batch size in samples per optimizer step (default: one sample per GPU)")
    wl.add_argument("--seq-len", type=int, default=None, metavar="S",
                    help="sequence length (default: the model file's example inputs; inferred inputs use "
                         "min(max positions, 2048))")
    wl.add_argument("--precision", default="bf16", choices=PRECISIONS, help="training compute dtype")
    pin = parser.add_argument_group("pin part of the layout (everything pinned = estimate a hand layout)")
    pin.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    pin.add_argument("--pp", type=int, default=None, help="pipeline-parallel size")
    pin.add_argument("--dp", type=int, default=None, help="data-parallel size")
    pin.add_argument("--dp-shard", dest="dp_shard", type=int, default=None, metavar="N",
                     help="HSDP: shard ZeRO states over groups of N dp ranks, replicated across dp / N groups "
                          "(default: the planner prices whole-dp sharding and node-sized groups)")
    pin.add_argument("--ep", type=int, default=None, metavar="N",
                     help="expert parallelism: split each MoE layer's experts over groups of N dp ranks "
                          "(default: the planner tries the divisors of dp that divide the experts; 1: none)")
    pin.add_argument("--cp", type=int, default=None, metavar="N",
                     help="context parallelism: cut every sequence over N ranks (ring attention; default: the "
                          "planner tries it where one sequence's activations do not fit, or cp pays)")
    pin.add_argument("--micro-batch", type=int, default=None, metavar="N", help="samples per micro-batch")
    pin.add_argument("--zero", type=int, default=None, choices=(0, 1, 2, 3), help="ZeRO level of every layer")
    pin.add_argument("--checkpoint", default=None, choices=("none", "selective", "full"),
                     help="activation checkpointing of every layer")
    pin.add_argument("--offload", default=None, choices=("none", "optimizer", "params"), help="CPU offload of every layer")
    pin.add_argument("--schedule", default=None, metavar="NAME", help="gpipe, 1f1b, interleaved or interleaved:V")
    pin.add_argument("--sequence-parallel", dest="sequence_parallel", action=argparse.BooleanOptionalAction,
                     default=None, help="pin sequence parallelism on or off")
    pin.add_argument("--grad-reduce-dtype", dest="grad_reduce_dtype", default=None, choices=("fp32", "bf16", "auto"),
                     help="gradient reduction dtype (FSDP2 reduce_dtype, DeepSpeed communication_data_type): bf16 "
                          "compresses fp32 gradients; auto keeps bf16 where it is faster (default: reduce as held, "
                          "the gain said in the plan)")
    if engine:
        add_engine_arguments(parser)
    parser.add_argument("--fusion", dest="fusion", action=argparse.BooleanOptionalAction, default=True,
                        help="record the fusable op chains (bias+GELU, add+norm, ...) in the plan and charge "
                             "their saved HBM traffic on GPU devices (default: on)")
    parser.add_argument("--time-limit", type=float, default=1.0, metavar="S",
                        help="CP-SAT deterministic time limit (work units, about seconds) per candidate left "
                             "unproven by the first pass (default 1)")
    parser.add_argument("--memory-headroom", type=float, default=None, metavar="H",
                        help="share of each GPU's usable memory the plan leaves free, 0 <= H < 1: predicted peak "
                             "<= (1 - H) x usable (default 0.1, for what the cost model does not see: optimizer "
                             "temporaries, NCCL buffers, allocator fragmentation)")


def apply_model_size(args) -> None:
    """`--model-size SIZE [--family F]` stands for the model file autopar/zoo/sized.py:F_SIZE,
    said on stderr with the shape it resolved to; a model file or the size, not both."""
    size = getattr(args, "model_size", None)
    if size is None:
        if getattr(args, "model_required", False) and args.model is None:
            raise AutoparError("no model: give a model file (path.py[:factory]) or --model-size SIZE",
                               hint="e.g. autopar plan examples/gpt.py:gpt3_175b --gpus 1024, or "
                                    "autopar plan --model-size 6B --gpus 32")
        return
    if args.model is not None:
        raise AutoparError(f"both a model file ({args.model}) and --model-size {size}: give one of them")
    from autopar.zoo import sized
    try:
        args.model = sized.spec_for(args.family, size)
        said = sized.describe(args.family, size, getattr(args, "seq_len", None))
    except ValueError as exc:
        raise AutoparError(str(exc), hint="e.g. --model-size 125M, --model-size 6B, --model-size 70B --family "
                                          "llama3") from None
    print(f"autopar {args.command}: --model-size {size}: {said}", file=sys.stderr, flush=True)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    from autopar.engine import ATTENTION_KERNELS, ENGINES, MAIN_GRADS, OPTIMIZER_IMPLS

    eng = parser.add_argument_group(
        "engine (price a run another training engine makes; default: autopar's own program, which "
        "`autopar compile` emits and which is the only one it lowers)")
    eng.add_argument("--engine", default=None, choices=tuple(ENGINES),
                     help="megatron: Megatron-LM / Megatron-core / NeMo (fused Adam, fp32 main gradients, "
                          "distributed optimizer as ZeRO 1, Megatron's TP collectives); pytorch: hand-written "
                          "FSDP / DDP / torchtitan (foreach AdamW, ZeRO levels as pinned)")
    eng.add_argument("--tp-comm-overlap", dest="tp_comm_overlap", action="store_const", const=True, default=None,
                     help="TP collectives overlapped with the GEMMs (Megatron-core --tp-comm-overlap, "
                          "Transformer Engine userbuffers)")
    eng.add_argument("--main-grads", default=None, choices=MAIN_GRADS,
                     help="gradients reduced and accumulated in fp32 or in the training dtype")
    eng.add_argument("--optimizer-impl", default=None, choices=OPTIMIZER_IMPLS,
                     help="fused (apex / Megatron / torch fused=True) or foreach (torch's default) Adam")
    eng.add_argument("--compile", dest="compiled_blocks", action="store_const", const=True, default=None,
                     help="price autopar's program with every block torch.compile'd (as it runs on CUDA by "
                          "default): inductor's fused memory-bound chains and fewer kernel launches")
    eng.add_argument("--float8", dest="float8", action="store_const", const=True, default=None,
                     help="with --compile: run each layer's nn.Linear GEMMs in float8 (torchao, tensorwise "
                          "scaling) where that is faster on this GPU at the layer's shapes; GPUs with float8 "
                          "tensor cores only (H100, H200, B200, L40S)")
    eng.add_argument("--attention-kernel", default=None, choices=ATTENTION_KERNELS,
                     help="the fused attention kernel the run used: flash2 (SDPA's, the default), flash1, "
                          "flash-triton (the 2022 Triton kernel, e.g. MPT's attn_impl: triton)")


ENGINE_OPTIONS = ("engine", "tp_comm_overlap", "main_grads", "optimizer_impl", "attention_kernel", "compiled_blocks",
                  "float8")


def engine_from_args(args):
    from autopar.engine import engine_from_options

    return engine_from_options(getattr(args, "engine", None),
                               **{k: getattr(args, k, None) for k in ENGINE_OPTIONS[1:]})


# Options that only matter when planning (None = not given): meaningless next to a saved --plan.
PLANNING_OPTIONS = ("gpus", "gpus_per_node", "device", "cluster", "batch_size", "seq_len", "tp", "pp", "dp",
                    "dp_shard", "ep", "cp", "micro_batch", "zero", "checkpoint", "offload", "schedule",
                    "sequence_parallel", "memory_headroom", "grad_reduce_dtype", *ENGINE_OPTIONS)


def planning_options_given(args, allowed: tuple[str, ...] = ()) -> list[str]:
    """The planning flags set on the command line, as '--flag' (excluding `allowed`)."""
    return ["--" + k.replace("_", "-") for k in PLANNING_OPTIONS
            if k not in allowed and getattr(args, k, None) is not None]


def check_report_path(path: str, flag: str) -> None:
    """An HTML report destination that will work, checked before planning
    (a 1,024-GPU search takes minutes; failing to write after it wastes them)."""
    if not path.endswith((".html", ".htm")):
        raise AutoparError(f"{flag} {path}: the report file must end in .html", hint=f"e.g. {flag} plan.html")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise AutoparError(f"{flag} {path}: folder {folder} does not exist",
                           hint="create it first, or write the report elsewhere")


def constraints_from_args(args) -> dict:
    keys = ("tp", "pp", "dp", "dp_shard", "ep", "cp", "micro_batch", "zero", "checkpoint", "schedule",
            "sequence_parallel", "offload", "grad_reduce_dtype")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def cluster_from_args(args):
    """ClusterSpec from --cluster / --device / --gpus / --gpus-per-node."""
    from cost_models.errors import CostModelError
    from cost_models.hardware import ClusterSpec

    for flag, value in (("--gpus", args.gpus), ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and value < 1:
            raise ClusterSpecError(f"{flag} must be a positive integer, got {value}")
    if args.cluster and args.device:
        raise ClusterSpecError("--cluster and --device both name the hardware; pass one of them",
                               hint="a cluster file names its device; --gpus still scales its node count")
    if args.cluster and not os.path.isfile(args.cluster) and _looks_like_path(args.cluster):
        raise ClusterSpecError(f"cluster file not found: {args.cluster}",
                               hint="pass an existing YAML/JSON file, or a preset with --device "
                                    "(e.g. --device dgx-h100)")
    name = args.cluster or args.device or DEFAULT_DEVICE
    try:
        base = ClusterSpec.resolve(name)
    except CostModelError as exc:
        if getattr(exc, "file", None) is None:  # a name, not a file: the flag is the "field"
            flag = "--cluster" if args.cluster else "--device"
            raise ClusterSpecError(f"{flag} {name}: {_profile_text(exc)}",
                                   hint="a device profile with --gpus N, a preset (dgx-h100:16 = 16 nodes), "
                                        "or a cluster file with --cluster") from None
        raise cluster_error(exc) from None
    from cost_models.errors import ClusterSizeError
    from cost_models.hardware import split_gpu_count

    d = base.to_dict()
    gpn = args.gpus_per_node or d["gpus_per_node"]
    gpus = args.gpus or (d["nodes"] * gpn if args.cluster else gpn)
    try:  # the rule autopar.ClusterSpec(gpus=N) follows too, so both plan the same cluster
        nodes, gpn = split_gpu_count(gpus, gpn, per_node_given=bool(args.gpus_per_node),
                                     hardware=_hardware_name(args))
    except ClusterSizeError as exc:
        raise ClusterSpecError(exc.message, hint=exc.hint) from None
    # planner.scaled_cluster, without importing the solver (ortools, sympy) for a flag check
    scaled = {**d, "nodes": nodes, "gpus_per_node": gpn}
    scaled.pop("world_size", None)  # derived; from_dict checks it against nodes x gpus_per_node
    try:
        cluster = ClusterSpec.from_dict(scaled, file=base.source)
        if getattr(args, "profile", None):
            if not os.path.isfile(args.profile):
                raise ClusterSpecError(f"--profile {args.profile}: file not found",
                                       hint="write one with `autopar calibrate -o FILE`")
            cluster = cluster.with_profile(args.profile)
        return cluster
    except CostModelError as exc:
        raise cluster_error(exc) from None


def _looks_like_path(value: str) -> bool:
    return os.sep in value or value.endswith((".yaml", ".yml", ".json"))


def _hardware_name(args) -> str:
    return args.cluster or args.device or DEFAULT_DEVICE


def node_count_hint(gpus: int, gpn: int) -> str:
    """What to pass instead of a GPU count that is not whole nodes (cost_models.hardware.node_count_hint)."""
    from cost_models.hardware import node_count_hint as hint

    return hint(gpus, gpn)


def _profile_text(exc) -> str:
    """A ProfileError's own words, without the "(field 'x' in FILE)" it appends."""
    field, file = getattr(exc, "field", None), getattr(exc, "file", None)
    text = str(exc)
    for suffix in (f" (field '{field}' in {file})", f" (in {file})", f" (field '{field}')"):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
            break
    return text.replace('in "<unicode string>", ', "")  # yaml's name for the text it parsed


def cluster_error(exc) -> ClusterSpecError:
    """A cost_models ProfileError as a ClusterSpecError that leads with the file and
    field (ProfileError says them last; the eye lands first)."""
    field, file = getattr(exc, "field", None), getattr(exc, "file", None)
    text = _profile_text(exc)
    where = " ".join(x for x in (f"{file}:" if file and file != "<dict>" else "",
                                 f"field '{field}':" if field else "") if x)
    return ClusterSpecError(f"{where} {text}".strip() if where else text,
                            hint="see the cluster file format in cost_models/hardware.py "
                                 "(or docs/cost_model.md); presets: --device dgx-h100, dgx-a100, ...")


def load_graph(args):
    """Load the model file and capture it (the ModelGraph the planner and report read).

    --seq-len sets the length of inferred inputs (a file without
    example_inputs) directly; a file's own inputs are traced at their length
    and the planner evaluates the fitted expressions at --seq-len.
    """
    from autopar.model_file import load_model

    seq_len = getattr(args, "seq_len", None)
    if seq_len is not None and seq_len < 1:  # before the model is built and traced
        raise AutoparError(f"--seq-len must be a positive integer, got {seq_len}")
    loaded = load_model(args.model, seq_len=seq_len)
    # Captured at the --precision it trains in: scaling a bf16 capture's bytes by 2 would
    # price its fp32 upcasts (norms, softmax statistics) at 8 bytes an element. The model
    # file's loss_fn runs in training, so its cost (the saved log-softmax of the logits,
    # its bytes and FLOPs) is part of the head layer (inspect does this on --loss).
    loss_fn = loss_fn_to_capture(loaded)
    precision = getattr(args, "precision", None) or "bf16"
    try:
        graph = capture_loaded(loaded, loss_fn=loss_fn, dtype=precision)
    except AutoparError as exc:
        if loss_fn is None:
            raise
        # A loss the meta-device trace cannot run (.item(), data-dependent code): plan the
        # model without it, and say so rather than fail a plan that worked before.
        graph = capture_loaded(loaded, dtype=precision)
        note = (f"loss_fn left out of the head layer: tracing it failed ({exc.message}); its cost is not "
                "in this plan")
        graph.notes.append(note)
        print(f"autopar: {note}", file=sys.stderr)
    check_seq_len(graph, loaded.model, seq_len)
    if loaded.inputs_note:
        graph.notes.insert(0, loaded.inputs_note)
        if not getattr(args, "json", False):
            print(f"autopar: {loaded.inputs_note}", file=sys.stderr)
    if getattr(graph, "source", None) in (None, ""):
        try:
            graph.source = args.model
        except AttributeError:  # a frozen graph type: the plan records the source itself
            pass
    return graph, loaded


def loss_fn_to_capture(loaded):
    """The model file's loss_fn, unless the inferred inputs carry labels (then the
    model's forward computes its own loss and captures it already)."""
    if getattr(loaded.example_inputs, "computes_loss", False):
        return None
    return loaded.loss_fn


def capture_loaded(loaded, **kwargs):
    """capture() of a loaded model file; when its inputs were inferred and
    capture fails, the hint says what was assumed and how to change it."""
    from autopar.capture import capture
    from autopar.errors import CaptureError

    try:
        return capture(loaded.model, loaded.example_inputs, name=loaded.name, **kwargs)
    except CaptureError as exc:
        if not loaded.inputs_note:
            raise
        hint = (f"{loaded.inputs_note[0].upper()}{loaded.inputs_note[1:]}. If these are not the model's inputs, "
                "pass --seq-len or define example_inputs(batch_size) in the model file")
        raise CaptureError(exc.message, hint=f"{exc.hint}\n  {hint}" if exc.hint else hint) from None


def check_seq_len(graph, model, seq_len) -> None:
    """--seq-len must be a length the model can take: it needs a sequence axis
    and must fit a learned position table (the meta device would not fail on
    an out-of-range position, it would cost it)."""
    from autopar.capture.auto_inputs import learned_position_table

    if seq_len is None:
        return
    if seq_len < 1:
        raise AutoparError(f"--seq-len must be a positive integer, got {seq_len}")
    if graph.seq_len is None:
        raise AutoparError(f"--seq-len {seq_len} given, but {graph.name} has no sequence axis "
                           "(its inputs have no token dimension, e.g. images)",
                           hint="drop --seq-len; the costs are per sample")
    if seq_len != graph.seq_len and getattr(graph, "seq_fit", "wide") == "none":
        raise AutoparError(f"--seq-len {seq_len}: {graph.name}'s costs were measured at sequence length "
                           f"{graph.seq_len} only (see the capture note), so they cannot be evaluated at another",
                           hint=f"make example_inputs return sequences of length {seq_len}, or drop --seq-len")
    table = learned_position_table(model)
    if table is not None and seq_len > table[1]:
        raise AutoparError(f"--seq-len {seq_len} is longer than the model's learned position table "
                           f"{table[0]} ({table[1]} positions)", hint=f"pass --seq-len {table[1]} or less")


def plan_from_args(args, progress=None):
    """(Plan, ModelGraph) for the shared plan options."""
    from autopar.errors import InfeasibleError
    from autopar.solve import plan
    from autopar.solve.constraints import check_against_cluster, parse_constraints

    cluster = cluster_from_args(args)
    # Pinned flags that cannot work (an unknown schedule, --tp 3 on 16 GPUs) fail
    # here, in milliseconds, rather than after the model is imported and traced.
    if not args.time_limit > 0:  # also refuses nan
        raise AutoparError(f"--time-limit must be a positive number of seconds, got {args.time_limit}")
    if args.batch_size is not None and args.batch_size < 1:
        raise AutoparError(f"--batch-size must be a positive integer, got {args.batch_size}")
    headroom = getattr(args, "memory_headroom", None)
    if headroom is not None and not 0 <= headroom < 1:  # also refuses nan
        raise AutoparError(f"--memory-headroom must be a fraction of usable memory in [0, 1), got {headroom}",
                           hint="e.g. --memory-headroom 0.1 leaves 10% free; 0 plans up to the usable memory")
    engine = engine_from_args(args)  # a bad combination fails here, before the capture
    pins = parse_constraints(constraints_from_args(args))
    check_against_cluster(pins, cluster.world_size, args.batch_size or cluster.world_size)
    graph, loaded = load_graph(args)
    try:
        from autopar.lower.what_runs import limits
        result = plan(graph, cluster, loaded.example_inputs, global_batch_size=args.batch_size,
                      constraints=constraints_from_args(args), check_lowering=limits,
                      seq_len=args.seq_len, precision=args.precision, top_k=getattr(args, "top", 5),
                      time_limit_s=args.time_limit, progress=progress, source=args.model,
                      fusion=getattr(args, "fusion", True), module=loaded.model, memory_headroom=headroom,
                      engine=engine)
    except InfeasibleError as exc:
        # The advice under an out-of-memory error compares devices with this one.
        if exc.capacity_bytes is None:
            exc.capacity_bytes = cluster.device_profile.memory_bytes
        exc.device = exc.device or cluster.device_profile.name
        raise
    return result, graph


def stderr_is_tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


__all__ = ["add_plan_arguments", "apply_model_size", "node_count_hint", "cluster_error", "plan_from_args", "cluster_from_args", "constraints_from_args", "load_graph",
           "capture_loaded", "check_seq_len", "AutoparError"]
