"""The training job `autopar compile` emits (`build/train.py` calls `main`).

    torchrun --nproc_per_node N build/train.py --data tokens.bin --steps 1000 \\
        --lr 3e-4 --warmup 100 --decay cosine --clip 1.0 --save-dir ckpt --save-every 100

One process per rank: load the model file and plan.json, compile (this rank's
shards only), resume from the newest complete snapshot in --save-dir (saved
under any plan: `snapshot`), read this dp rank's share of global batch k at
step k (`data.GlobalBatches`), step with clipping by the global norm and the
learning-rate schedule, log each step beside the plan's prediction
(`metrics.Metrics`), and snapshot every --save-every steps, at the end, and
when SIGTERM / SIGUSR1 arrives (a scheduler's preemption notice) or on a first
Ctrl-C (a second stops at once).
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.lower.batch_norm import batch_norms
from autopar.train import snapshot
from autopar.train.data import TOKEN_DTYPES, BatchSizes, GlobalBatches, Synthetic, TokenFile
from autopar.train.metrics import Metrics
from autopar.train.plot import plot_path, plot_run
from autopar.train.schedule import DECAYS, lr_scheduler


def parser(description: str = "train with the layout autopar planned") -> argparse.ArgumentParser:
    # One piece over 80 lines: the job's whole command line, group by group, is what
    # `train.py --help` prints; split up it would only scatter the flags.
    ap = argparse.ArgumentParser(description=description)
    data = ap.add_argument_group("data")
    source, held_out = data.add_mutually_exclusive_group(), data.add_mutually_exclusive_group()
    source.add_argument("--data", default=None, metavar="FILE",
                        help="flat binary of token ids (nanoGPT / Megatron style), read by memory map")
    source.add_argument("--text", nargs="+", default=None, metavar="FILE",
                        help="UTF-8 text files (a .jsonl file: one document per line's \"text\"), tokenized once "
                             "by rank 0 into a token file beside the first (FILE.<hash>.u16|u32, reused while the "
                             "text and tokenizer are unchanged), then read as --data reads one")
    held_out.add_argument("--eval-data", default=None, metavar="FILE",
                          help="a held-out token file: its loss and perplexity every --eval-every steps and at the "
                               "end (in the metrics as eval_loss, eval_perplexity)")
    held_out.add_argument("--eval-text", default=None, metavar="FILE",
                          help="held-out text, tokenized as --text is, used as --eval-data")
    data.add_argument("--tokenizer", default=None, metavar="SPEC",
                      help="what tokenizes --text / --eval-text: model (default: the model file's tokenizer()), "
                           "a Hugging Face tokenizer's folder or name (transformers.AutoTokenizer), or "
                           "file:tokenizer.json (the tokenizers library)")
    data.add_argument("--eval-every", type=int, default=0, metavar="N",
                      help="evaluate every N steps (default 0: only at the end)")
    data.add_argument("--eval-batches", type=int, default=8, metavar="K",
                      help="global batches of --eval-data per evaluation, always the same ones (default 8)")
    data.add_argument("--data-dtype", default="uint16", choices=sorted(TOKEN_DTYPES),
                      help="token dtype of --data (default uint16; --text chooses its own from the vocabulary)")
    data.add_argument("--synthetic", action="store_true",
                      help="random inputs shaped as the model's example inputs (a smoke test, nothing to learn)")
    data.add_argument("--seed", type=int, default=0, help="weights, data order and dropout (default 0)")
    data.add_argument("--batch-size", type=int, default=None, metavar="B",
                      help="global batch of this run (default: the plan's): more or fewer of the plan's "
                           "micro-batches per step, where its layout allows (refused otherwise, with the fix)")
    data.add_argument("--batch-ramp", default=None, metavar="START:STEPS",
                      help="grow the global batch linearly from START samples to the run's over the first STEPS "
                           "steps (GPT-3's batch warmup); every sample is still read once an epoch")
    data.add_argument("--init", default="auto", choices=("auto", "meta", "cpu"),
                      help="meta: build the model's parameters on the meta device and initialise only this "
                           "rank's shards (the model file's init_fn(module), else the model's own "
                           "_init_weights(module), after each module's reset_parameters; the same weights on "
                           "every layout); cpu: every rank builds the whole model in host memory first; auto "
                           "(default): meta when such an init exists, else cpu")
    run = ap.add_argument_group("what runs")
    run.add_argument("--compile", dest="compile", action=argparse.BooleanOptionalAction, default=None,
                     help="torch.compile each block (regional compilation, inductor; a block that does not compile "
                          "runs eager and is named at start-up). Default: on for CUDA devices, off on CPU")
    opt = ap.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    opt.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    opt.add_argument("--warmup", type=int, default=0, help="linear warmup steps (default 0)")
    opt.add_argument("--decay", default="constant", choices=DECAYS,
                     help="after warmup: cosine or linear down to --min-lr-ratio x lr at --steps (default constant)")
    opt.add_argument("--min-lr-ratio", type=float, default=0.1, help="floor of the decay (default 0.1)")
    opt.add_argument("--reschedule", action="store_true",
                     help="on resume, rebuild the learning-rate schedule from these --steps / --lr / --warmup / "
                          "--decay when they differ from the snapshot's (refused otherwise: the schedule's "
                          "shape would change silently)")
    opt.add_argument("--weight-decay", type=float, default=0.0,
                     help="AdamW weight decay; biases and norm gains are never decayed (default 0)")
    opt.add_argument("--clip", type=float, default=None, metavar="NORM",
                     help="clip gradients by their global norm over every dp / tp / pp shard")
    fp16 = ap.add_argument_group("fp16 plans: dynamic loss scaling (a step with an Inf / NaN gradient on any "
                                 "rank is skipped by all and the scale halves)")
    fp16.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16, metavar="S",
                      help="starting scale, a power of two (default 65536)")
    fp16.add_argument("--loss-scale-window", type=int, default=2000, metavar="N",
                      help="clean steps in a row before the scale doubles (default 2000)")
    snap = ap.add_argument_group("snapshots (torch.distributed.checkpoint; loadable under any plan)")
    snap.add_argument("--save-dir", default=None, metavar="DIR", help="where snapshots go (step-N directories)")
    snap.add_argument("--save-every", type=int, default=0, metavar="N",
                      help="snapshot every N steps (default 0: only at the end and on SIGTERM)")
    snap.add_argument("--keep", type=int, default=3, metavar="K", help="complete snapshots kept (default 3; 0 all)")
    snap.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                      help="auto (default): continue from the newest complete snapshot in --save-dir; "
                           "never: start over; PATH: a snapshot or a save dir (any plan's)")
    ap.add_argument("--init-from", default=None, metavar="SPEC",
                    help="start from pretrained weights: safetensors:FILE, hf:FOLDER (a Hugging Face checkpoint, "
                         "sharded or not), or a path; each rank reads only its shards, tensor by tensor")
    ap.add_argument("--preflight", action="store_true",
                    help="check the arguments, model, plan and data in one process and exit (launch.sh runs it "
                         "before torchrun, so an error a restart cannot fix is not restarted)")
    snap.add_argument("--export", default=None, metavar="FILE.safetensors",
                      help="at the end, the whole model (parameters and buffers) in one safetensors file")
    out = ap.add_argument_group("output")
    out.add_argument("--metrics", default=None, metavar="FILE",
                     help="per-step JSONL metrics (rank 0; default DIR/metrics.jsonl with --save-dir)")
    drawn = out.add_mutually_exclusive_group()
    drawn.add_argument("--plot", default=None, metavar="FILE.png",
                       help="where the run's plot goes at its end (rank 0; loss, step time and memory per step "
                            "beside the plan's predictions; default: the metrics file with the suffix .png)")
    drawn.add_argument("--no-plot", action="store_true", help="no plot at the end of the run")
    out.add_argument("--losses-out", default=None, help="write the per-step losses as JSON (rank 0)")
    out.add_argument("--quiet", action="store_true", help="no per-step line on the terminal")
    return ap


def _build(args, model_spec: str, plan):
    """(LoadedModel, init_fn): the model with meta parameters when it can be initialised
    shard by shard (--init), else built whole on the CPU as its constructor builds it."""
    from autopar.lower.model_io import default_init_fn
    from autopar.model_file import load_model

    if args.init == "cpu":
        return load_model(model_spec, device="cpu", seq_len=plan.seq_len), None
    loaded = load_model(model_spec, device="meta-params", seq_len=plan.seq_len)
    init_fn = loaded.init_fn if callable(loaded.init_fn) else default_init_fn(loaded.model)
    if init_fn is not None or args.init == "meta":
        return loaded, init_fn
    big = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    if os.environ.get("RANK", "0") == "0" and big > 1 << 30:
        print(f"autopar: every rank builds the whole model ({big / 2 ** 30:.1f} GiB of fp32 parameters) in host "
              "memory: define init_fn(module) in the model file (or give the model an _init_weights(module)) "
              "to build only each rank's shards, or pass --init meta when the modules' own "
              "reset_parameters is the model's whole init", file=sys.stderr, flush=True)
    torch.manual_seed(args.seed)  # the meta build drew nothing, but start from the seed exactly
    return load_model(model_spec, device="cpu", seq_len=plan.seq_len), None


def _preflight(args, model_spec: str, plan, plan_path: str) -> int:
    """What launch.sh runs once, in one process, before torchrun: every refusal that a
    restart cannot fix (the arguments, the model file, the model against its plan, the
    data) exits 2 here, instead of torchrun restarting every rank into it again."""
    from autopar.lower.model_layers import resolve
    from autopar.model_file import load_model

    loaded = load_model(model_spec, device="meta", seq_len=plan.seq_len)
    resolve(loaded.model, plan)  # the layers the plan names are this model's
    plan = _plan_for_batch(args, loaded, plan, plan_path, shared=False)  # the ranks then read it
    _batch_sizes(args, plan, batch_norms(loaded.model))
    _dataset(args, loaded, plan, loaded.dataset)
    print("autopar: preflight passed (model, plan, data, arguments)", file=sys.stderr, flush=True)
    return 0


def _vocab_size(model) -> int | None:
    """Rows of the model's token embedding: a Hugging Face model's own input embedding,
    else the largest nn.Embedding (position tables are shorter); None without one."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if isinstance(emb, torch.nn.Embedding):
        return emb.num_embeddings
    sizes = [m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    return max(sizes) if sizes else None


def _token_file(path: str, flag: str, args, loaded, plan) -> TokenFile:
    """A token file cut as this model reads it: windows of its sequence length, targets
    shifted for a file's loss_fn (a Hugging Face causal LM's own loss shifts its labels
    itself), ids checked against its vocabulary."""
    return TokenFile(path, _token_seq(loaded, plan, flag), args.data_dtype, shift=loaded.loss_fn is not None,
                     vocab_size=_vocab_size(loaded.model))


def _token_seq(loaded, plan, flag: str) -> int:
    """The sequence length a token file is cut into: the plan's, or (a hand-written plan)
    the example inputs' own length; refused for a model whose inputs are not token ids."""
    seq = plan.seq_len
    if seq is None:
        first = loaded.example_inputs(1)
        first = first[0] if isinstance(first, (tuple, list)) else first
        if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.dtype.is_floating_point:
            seq = first.shape[1]
    if seq is None:
        raise AutoparError(f"{flag} is a token file, and this model's inputs are not token ids",
                           hint="define dataset() in the model file returning (inputs, targets) samples")
    return seq


def _dataset(args, loaded, plan, module_dataset):
    shift = loaded.loss_fn is not None  # a Hugging Face causal LM's own loss shifts its labels itself
    # --text / --eval-text: tokenized once into token files, then read as --data / --eval-data are
    if any(getattr(args, k, None) for k in ("text", "eval_text", "tokenizer")):
        from autopar.train.text import prepare
        batch = getattr(args, "batch_size", None) or plan.global_batch_size  # --batch-size: this run's
        prepare(args, loaded, lambda flag: _token_seq(loaded, plan, flag), batch, _vocab_size(loaded.model))
    if args.data:
        return _token_file(args.data, "--data", args, loaded, plan)
    if module_dataset is not None:
        takes_model = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                          for p in inspect.signature(module_dataset).parameters.values())
        ds = module_dataset(loaded.model) if takes_model else module_dataset()
        if not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
            raise AutoparError(f"the model file's dataset() returned {type(ds).__name__}, not a map-style "
                               "torch Dataset of (inputs, targets)")
        return ds
    if args.synthetic:
        from autopar.lower.model_io import positional_inputs

        split = positional_inputs(loaded.model, loaded.example_inputs)
        return Synthetic(loaded.example_inputs, seed=args.seed, shift=shift, split=split)
    raise AutoparError("no training data", hint="pass --data tokens.bin, --text FILE, define dataset() in the "
                                                "model file, or --synthetic for random inputs")


def main(model_spec: str, plan_path: str, argv=None, description: str | None = None) -> int:
    args = parser(description or "train with the layout autopar planned").parse_args(argv)
    try:
        return _train(args, model_spec, plan_path)
    except AutoparError as exc:  # a message a person can act on, not a traceback
        if os.environ.get("RANK", "0") == "0":  # once, not once per rank
            print(f"autopar: {exc}", file=sys.stderr)
        return exc.exit_code


def _train(args, model_spec: str, plan_path: str) -> int:
    import autopar

    plan = autopar.Plan.load(plan_path)
    if args.steps < 1:
        raise AutoparError(f"--steps must be positive, got {args.steps}")
    if args.clip is not None and args.clip <= 0:
        raise AutoparError(f"--clip must be positive, got {args.clip}")
    if args.plot and not (args.metrics or args.save_dir):
        raise AutoparError("--plot draws the metrics file, and this run writes none",
                           hint="add --metrics FILE (or --save-dir DIR, which writes DIR/metrics.jsonl)")
    if args.preflight:
        return _preflight(args, model_spec, plan, plan_path)
    torch.manual_seed(args.seed)  # identical initial weights on every rank (and dropout streams)
    loaded, init_fn = _build(args, model_spec, plan)
    plan = _plan_for_batch(args, loaded, plan, plan_path, shared=True)
    sizes = _batch_sizes(args, plan, batch_norms(loaded.model))  # a batch the layout cannot run: refused now
    dataset = _dataset(args, loaded, plan, loaded.dataset)
    pm = _compile(args, loaded, init_fn, plan)
    rank = dist.get_rank()
    batches = GlobalBatches(dataset, sizes.final, plan.mesh.dp, pm.dp_rank, seed=args.seed, sizes=sizes)
    held_out = _eval_batches(args, loaded, plan, pm)
    start, schedule_at = _resume(args, pm, batches)
    if args.init_from:
        if start:
            if rank == 0:
                print(f"autopar: --init-from {args.init_from} ignored: resuming at step {start}", file=sys.stderr)
        else:
            from autopar.train.pretrained import load_pretrained
            count = load_pretrained(pm, args.init_from)
            if rank == 0:
                print(f"autopar: initialised from {args.init_from} ({count} tensors on rank 0)", file=sys.stderr,
                      flush=True)
    pm.lr_scheduler = lr_scheduler(pm.optimizer, warmup=args.warmup, total=args.steps, decay=args.decay,
                                   min_ratio=args.min_lr_ratio, start_step=schedule_at)
    metrics_path = args.metrics or (os.path.join(args.save_dir, "metrics.jsonl") if args.save_dir else None)
    metrics = Metrics(plan, path=metrics_path, rank=rank, start_step=start)
    uncalibrated = metrics.uncalibrated()
    if rank == 0 and uncalibrated:
        print(f"autopar: {uncalibrated}", file=sys.stderr, flush=True)
    stop = _StopSignal()
    losses, saved_at = [], start if start else None
    for step in range(start, args.steps):
        loss, stopping = _step(args, pm, batches, metrics, stop, step, held_out)
        if step == start and pm.first_step_s is not None and rank == 0:
            print(f"autopar: the first step took {pm.first_step_s:.1f} s, compiling the blocks included",
                  file=sys.stderr, flush=True)
        losses.append(loss)
        done = step + 1
        if args.save_dir and (stopping or done == args.steps or (args.save_every and done % args.save_every == 0)):
            path = snapshot.save(pm, args.save_dir, done, {"data": batches.state_dict(), "seed": args.seed,
                                                           "schedule": _schedule(args)},
                                 keep=args.keep)
            saved_at = done
            if rank == 0 and not args.quiet:
                print(f"snapshot {path}", flush=True)
        if stopping:
            if rank == 0:
                where = f"snapshot at step {saved_at} in {args.save_dir}" if args.save_dir else "no --save-dir"
                print(f"autopar: stopped by signal after step {done} ({where}); run the same command to "
                      "continue", file=sys.stderr, flush=True)
            break
    stop.restore()
    _finish(args, pm, plan, metrics, losses, saved_at)
    return 0


def _not_whole_micro_batches(plan, size: int) -> str | None:
    """Why a global batch of `size` is no whole number of the plan's micro-batches on every dp rank."""
    quantum = plan.micro_batch_size * plan.mesh.dp
    if size >= 1 and size % quantum == 0:
        return None
    return (f"the plan's layout runs whole micro-batches of {plan.micro_batch_size} on each of its {plan.mesh.dp} "
            f"data-parallel ranks, so the global batch must be a multiple of {quantum}")


def _final_batch_refusal(plan, size: int, batch_norms: list[str]) -> str | None:
    """Why the plan's layout cannot run a global batch of `size` (None: it can)."""
    from autopar.lower.parallel_model import runtime_batch_refusal

    quantum = plan.micro_batch_size * plan.mesh.dp
    return _not_whole_micro_batches(plan, size) or runtime_batch_refusal(plan, size // quantum, batch_norms)


def _plan_for_batch(args, loaded, plan, plan_path: str, *, shared: bool):
    """The plan this run trains with: the build's, unless --batch-size asks for a global
    batch its layout cannot run; then the same request re-planned at that batch (every
    pin, the precision and the engine kept), written beside the build's plan as
    plan.batch-B.json and read from there when the preflight (or an earlier run) made it
    from the same plan. A batch nothing fits is refused as `autopar plan` refuses it.
    A plan written by hand is kept (and the batch refused with the fix): the planner
    did not choose its layout, so it does not choose another.
    `shared` (inside the job): rank 0 alone reads or plans, and every rank gets its plan."""
    from autopar.lower.api import plan_on_rank0

    final = args.batch_size
    if not final or final == plan.global_batch_size or final < 1:
        return plan  # (< 1 is refused with the others by _batch_sizes)
    why = _final_batch_refusal(plan, final, batch_norms(loaded.model))
    if why is None or (plan.solver or {}).get("status") not in ("optimal", "feasible"):
        return plan  # a layout chosen by hand is not re-chosen behind its author's back: refused below
    make = lambda: _replanned(loaded, plan, plan_path, final, why)  # noqa: E731
    return plan_on_rank0(make) if shared else make()


def _replanned(loaded, plan, plan_path: str, final: int, why: str):
    """plan.batch-B.json beside the build's plan when it was made from this plan, else planned and written."""
    import hashlib

    from autopar.lower.api import replan
    from autopar.plan import Plan

    with open(plan_path, "rb") as f:
        made = {"plan": hashlib.sha256(f.read()).hexdigest()[:16], "global_batch_size": final}
    path = os.path.join(os.path.dirname(os.path.abspath(plan_path)), f"plan.batch-{final}.json")
    if os.path.exists(path):
        try:
            kept = Plan.load(path)
        except Exception:  # noqa: BLE001 - an unreadable file is planned and written again
            kept = None
        if kept is not None and kept.solver.get("replanned_from") == made:
            return kept
    print(f"autopar: --batch-size {final}: the plan (global batch {plan.global_batch_size}) cannot run it: {why}; "
          f"re-planning for {final} ...", file=sys.stderr, flush=True)
    new = replan(plan, loaded.model, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                 global_batch_size=final)
    new.solver["replanned_from"] = made
    tmp = f"{path}.{os.getpid()}.partial"
    new.save(tmp)
    os.replace(tmp, path)  # whole or absent
    m = new.mesh
    print(f"autopar: re-planned for a global batch of {final}: pp{m.pp} x dp{m.dp} x tp{m.tp}, micro-batch "
          f"{new.micro_batch_size} x {new.num_micro_batches}, predicted {new.predicted.step_time_s:.3g} s a step "
          f"(written to {path})", file=sys.stderr, flush=True)
    return new


def _batch_sizes(args, plan, batch_norms: list[str]) -> BatchSizes:
    """Each step's global batch: --batch-size (default the plan's), ramped up by --batch-ramp;
    every size refused here that the plan's layout cannot run (parallel_model.runtime_batch_refusal)."""
    from autopar.lower.parallel_model import runtime_batch_refusal

    final = args.batch_size or plan.global_batch_size
    quantum = plan.micro_batch_size * plan.mesh.dp
    fix = (f"re-plan for it: autopar compile MODEL --batch-size {final} (plus the flags you planned with), "
           f"or pick a multiple of {quantum}")
    not_whole = _not_whole_micro_batches(plan, final)
    if not_whole:
        raise AutoparError(f"--batch-size {final}: {not_whole}", hint=fix)
    start, steps = None, 0
    if args.batch_ramp:
        try:
            start, steps = (int(x) for x in args.batch_ramp.split(":"))
        except ValueError:
            raise AutoparError(f"--batch-ramp {args.batch_ramp!r}: expected START:STEPS, e.g. 32:1000") from None
    sizes = BatchSizes(final, quantum, start, steps)
    for size in sorted({sizes.size(k) for k in range(sizes.steps)} | {final}):
        why = runtime_batch_refusal(plan, size // quantum, batch_norms)
        if why:
            raise AutoparError(f"a global batch of {size}: {why}", hint=fix)
    return sizes


def _compile(args, loaded, init_fn, plan):
    """This rank's ParallelModel, with AdamW, clipping by the global norm and (fp16) the loss scale."""
    import autopar

    pm = autopar.compile(loaded.model, plan.cluster, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                         init_fn=init_fn, optimizer=torch.optim.AdamW,
                         optimizer_kwargs={"lr": args.lr, "weight_decay": args.weight_decay},
                         plan=plan, local_batch=True, no_weight_decay_1d=True,
                         torch_compile="auto" if args.compile is None else args.compile)
    pm.max_grad_norm, pm.track_grad_norm = args.clip, True
    if dist.get_rank() == 0 and pm.compiled_blocks is not None:  # blocks that fall back are named after step 1
        print(f"autopar: {pm.compiled_blocks.start_note()}", file=sys.stderr, flush=True)
    if pm.grad_scaler is not None:
        pm.grad_scaler.configure(init_scale=args.initial_loss_scale, growth_interval=args.loss_scale_window)
    return pm


def _eval_batches(args, loaded, plan, pm):
    """The held-out batches (--eval-data): the first --eval-batches global batches in file
    order, each dp rank reading its share as in training; None without --eval-data."""
    if not args.eval_data:
        return None
    if args.eval_every < 0 or args.eval_batches < 1:
        raise AutoparError("--eval-every must be >= 0 and --eval-batches >= 1")
    data = _token_file(args.eval_data, "--eval-data", args, loaded, plan)
    batches = GlobalBatches(data, plan.global_batch_size, plan.mesh.dp, pm.dp_rank, seed=0, shuffle=False)
    count = min(args.eval_batches, batches.batches_per_epoch)
    if count < 1:
        raise AutoparError(f"--eval-data {args.eval_data}: fewer tokens than one global batch of "
                           f"{plan.global_batch_size} sequences")
    return [batches.batch(i) for i in range(count)]


def _duration(seconds: float) -> str:
    """'2h05m', '3m12s', '41s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _evaluate(pm, held_out) -> float:
    """Mean loss over the held-out batches (the same ones every time), under the plan's layout."""
    return sum(pm.eval_step(inputs, targets) for inputs, targets in held_out) / len(held_out)


def _step(args, pm, batches, metrics: Metrics, stop, step: int, held_out=None) -> tuple[float, bool]:
    """One optimizer step on global batch `step`, recorded and (rank 0) printed; the
    held-out loss after it when due. -> (loss, whether a stop signal reached any rank)."""
    inputs, targets = batches.batch(step)
    lr = pm.optimizer.param_groups[0]["lr"]
    scale = pm.grad_scaler.scale_value() if pm.grad_scaler is not None else None
    t0 = time.perf_counter()
    loss = pm.train_step(inputs, targets)
    # Every rank's step time (a straggler shows here) and whether a stop signal
    # reached it, on the device the backend moves: all ranks stop at the same step.
    mine = torch.tensor([time.perf_counter() - t0, float(stop.received)], dtype=torch.float64, device=pm.device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    rank_times = [float(t[0].item()) for t in gathered]
    stopping = any(float(t[1].item()) for t in gathered)
    done = step + 1
    due = held_out is not None and (done == args.steps or stopping
                                    or (args.eval_every and done % args.eval_every == 0))
    eval_loss = _evaluate(pm, held_out) if due else None
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    metrics.record(step, loss=loss, step_time_s=max(rank_times), rank_times=rank_times,
                   grad_norm=pm.last_grad_norm, lr=lr, loss_scale=scale, skipped=pm.last_step_skipped,
                   peak_memory_bytes=peak, eval_loss=eval_loss, global_batch=batches.batch_size(step))
    if dist.get_rank() == 0 and not args.quiet:
        fp16 = "" if scale is None else f"  scale {scale:.0f}" + ("  skipped (overflow)" if pm.last_step_skipped
                                                                    else "")
        held = "" if eval_loss is None else \
            f"  eval loss {eval_loss:.6f} (perplexity {math.exp(min(eval_loss, 700)):.4g})"
        eta = metrics.eta_s(args.steps - done)
        print(f"step {step:5d}/{args.steps}  loss {loss:.6f}  grad norm {pm.last_grad_norm:.4g}  lr {lr:.3g}{fp16}  "
              f"{max(rank_times) * 1e3:.1f} ms{held}" + (f"  eta {_duration(eta)}" if eta is not None else ""),
              flush=True)
    return loss, stopping


def _finish(args, pm, plan, metrics: Metrics, losses: list, saved_at) -> None:
    """The export (every rank gathers, rank 0 writes), the plot, the summary and the
    losses, then leave the process group."""
    rank = dist.get_rank()
    if args.export:
        full = pm.full_state_dict(buffers=True)  # collective
        if rank == 0:
            snapshot.export_safetensors(full, args.export, {"autopar_step": saved_at or args.steps,
                                                            "model": plan.model.get("name")}, pm.tied_aliases)
    if rank == 0:
        png = plot_path(args.plot, args.no_plot, metrics.path)
        png = png and plot_run(metrics.path, png, plan)  # None after one line on a failure: never fails the run
        print(metrics.summary() + (f"\n  plot        {png}" if png else ""), flush=True)
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(losses, f)
    metrics.close()
    dist.destroy_process_group()


def _resume(args, pm, batches) -> tuple[int, int]:
    """Load the snapshot --resume names (every rank the same one: rank 0 decides) -> the step
    to start at and the learning-rate schedule's position (behind it by the fp16 steps skipped)."""
    if args.save_every < 0 or args.keep < 0:
        raise AutoparError("--save-every and --keep must be >= 0")
    if args.resume == "auto" and not args.save_dir:
        if dist.get_rank() == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
            print("autopar: torchrun restarts failed ranks, but without --save-dir a restart trains again "
                  "from step 0", file=sys.stderr, flush=True)
        return 0, 0
    choice = [snapshot.resolve(args.resume, args.save_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return 0, 0
    meta = snapshot.read_meta(choice[0])
    saved = snapshot.check_model(pm, choice[0])  # another model is named as such, before its data order
    changed = batches.resume(meta.get("data", {}), int(meta["step"]))
    if changed and dist.get_rank() == 0:
        print(f"autopar: {changed}", file=sys.stderr, flush=True)
    _check_schedule(args, meta.get("schedule"))
    meta = snapshot.load(pm, choice[0], saved)
    if dist.get_rank() == 0:
        saved = meta.get("mesh", {})
        layout = "" if meta["rng_restored"] else (
            f" (saved on pp {saved.get('pp')} x dp {saved.get('dp')} x tp {saved.get('tp')}, "
            f"{meta.get('world_size')} ranks: resharded; dropout streams start afresh)")
        print(f"resuming from {choice[0]} at step {meta['step']}{layout}", flush=True)
    step = int(meta["step"])
    return step, int(meta.get("lr_scheduler", {}).get("last_epoch", step))


def _schedule(args) -> dict:
    """What shapes the learning-rate schedule (kept in each snapshot)."""
    return {"steps": args.steps, "lr": args.lr, "warmup": args.warmup, "decay": args.decay,
            "min_lr_ratio": args.min_lr_ratio}


def _check_schedule(args, saved: dict | None) -> None:
    """A resumed run keeps its schedule's shape: a changed --steps (or lr, warmup, decay)
    would re-stretch it from the step it is at (lr jumping), so it is refused unless
    --reschedule says it is meant, and then said."""
    now = _schedule(args)
    changed = {k: (saved[k], now[k]) for k in now if saved and k in saved and saved[k] != now[k]}
    if not changed:
        return
    what = ", ".join(f"--{k.replace('_', '-')} {a} -> {b}" for k, (a, b) in changed.items())
    if not args.reschedule:
        raise AutoparError(f"the snapshot's learning-rate schedule differs from this run's ({what}): resuming "
                           f"would change its shape mid-run",
                           hint="pass the snapshot's values, or --reschedule to rebuild the schedule from these")
    if dist.get_rank() == 0:
        print(f"autopar: --reschedule: the learning-rate schedule is rebuilt ({what})", file=sys.stderr, flush=True)


class _StopSignal:
    """SIGTERM / SIGUSR1 (torchrun and SLURM pass them on before killing) and a first
    Ctrl-C (SIGINT, which a terminal sends every rank and torchrun) only set a flag: the
    step in flight finishes, every rank learns of it at the step's end, and all save the
    same step. A second Ctrl-C stops at once (KeyboardInterrupt), as a user pressing it
    twice means."""

    SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None),
                                getattr(signal, "SIGINT", None)) if s)

    def __init__(self):
        self.received = False
        self._old = {}
        for sig in self.SIGNALS:
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (embedded use): no handler
                pass

    def _handle(self, signum, frame):
        if signum == getattr(signal, "SIGINT", None):
            if self.received:
                signal.signal(signum, signal.default_int_handler)
                raise KeyboardInterrupt
            if os.environ.get("RANK", "0") == "0":
                print("autopar: Ctrl-C: finishing this step and saving a snapshot before stopping (Ctrl-C again "
                      "to stop now, unsaved)", file=sys.stderr, flush=True)
        self.received = True

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
