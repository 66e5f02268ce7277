"""The training job `autopar compile` emits (`build/train.py` calls `main`).

    torchrun --nproc_per_node N build/train.py --data tokens.bin --steps 1000 \\
        --lr 3e-4 --warmup 100 --decay cosine --clip 1.0 --metrics metrics.jsonl

One process per rank: load the model file and plan.json, compile (this rank's
shards only), read this dp rank's share of global batch k at step k
(`data.GlobalBatches`), step with clipping by the global norm and the
learning-rate schedule, and log each step beside the plan's prediction
(`metrics.Metrics`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from autopar.errors import AutoparError
from autopar.train.data import TOKEN_DTYPES, GlobalBatches, Synthetic, TokenFile
from autopar.train.metrics import Metrics
from autopar.train.schedule import DECAYS, lr_scheduler


def parser(description: str = "train with the layout autopar planned") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    data = ap.add_argument_group("data")
    data.add_argument("--data", default=None, metavar="FILE",
                      help="flat binary of token ids (nanoGPT / Megatron style), read by memory map")
    data.add_argument("--data-dtype", default="uint16", choices=sorted(TOKEN_DTYPES),
                      help="token dtype of --data (default uint16)")
    data.add_argument("--synthetic", action="store_true",
                      help="random inputs shaped as the model's example inputs (a smoke test, nothing to learn)")
    data.add_argument("--seed", type=int, default=0, help="weights, data order and dropout (default 0)")
    opt = ap.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    opt.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (default 3e-4)")
    opt.add_argument("--warmup", type=int, default=0, help="linear warmup steps (default 0)")
    opt.add_argument("--decay", default="constant", choices=DECAYS,
                     help="after warmup: cosine or linear down to --min-lr-ratio x lr at --steps (default constant)")
    opt.add_argument("--min-lr-ratio", type=float, default=0.1, help="floor of the decay (default 0.1)")
    opt.add_argument("--weight-decay", type=float, default=0.0,
                     help="AdamW weight decay; biases and norm gains are never decayed (default 0)")
    opt.add_argument("--clip", type=float, default=None, metavar="NORM",
                     help="clip gradients by their global norm over every dp / tp / pp shard")
    out = ap.add_argument_group("output")
    out.add_argument("--metrics", default=None, metavar="FILE", help="per-step JSONL metrics (rank 0)")
    out.add_argument("--losses-out", default=None, help="write the per-step losses as JSON (rank 0)")
    out.add_argument("--quiet", action="store_true", help="no per-step line on the terminal")
    return ap


def _dataset(args, loaded, plan, module_dataset):
    shift = loaded.loss_fn is not None  # a Hugging Face causal LM's own loss shifts its labels itself
    if args.data:
        seq = plan.seq_len
        if seq is None:  # a hand-written plan: the example inputs' own length
            first = loaded.example_inputs(1)
            first = first[0] if isinstance(first, (tuple, list)) else first
            if isinstance(first, torch.Tensor) and first.dim() == 2 and not first.dtype.is_floating_point:
                seq = first.shape[1]
        if seq is None:
            raise AutoparError("--data is a token file, and this model's inputs are not token ids",
                               hint="define dataset() in the model file returning (inputs, targets) samples")
        return TokenFile(args.data, seq, args.data_dtype, shift=shift)
    if module_dataset is not None:
        ds = module_dataset()
        if not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__"):
            raise AutoparError(f"the model file's dataset() returned {type(ds).__name__}, not a map-style "
                               "torch Dataset of (inputs, targets)")
        return ds
    if args.synthetic:
        from autopar.lower.model_io import positional_inputs

        split = positional_inputs(loaded.model, loaded.example_inputs)
        return Synthetic(loaded.example_inputs, seed=args.seed, shift=shift, split=split)
    raise AutoparError("no training data", hint="pass --data tokens.bin, define dataset() in the model file, "
                                                "or --synthetic for random inputs")


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
    from autopar.model_file import load_model

    plan = autopar.Plan.load(plan_path)
    if args.steps < 1:
        raise AutoparError(f"--steps must be positive, got {args.steps}")
    if args.clip is not None and args.clip <= 0:
        raise AutoparError(f"--clip must be positive, got {args.clip}")
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    loaded = load_model(model_spec, device="cpu", seq_len=plan.seq_len)
    dataset = _dataset(args, loaded, plan, loaded.dataset)
    pm = autopar.compile(loaded.model, plan.cluster, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                         optimizer=torch.optim.AdamW,
                         optimizer_kwargs={"lr": args.lr, "weight_decay": args.weight_decay},
                         plan=plan, local_batch=True, no_weight_decay_1d=True)
    pm.max_grad_norm, pm.track_grad_norm = args.clip, True
    pm.lr_scheduler = lr_scheduler(pm.optimizer, warmup=args.warmup, total=args.steps, decay=args.decay,
                                   min_ratio=args.min_lr_ratio)
    rank = dist.get_rank()
    batches = GlobalBatches(dataset, plan.global_batch_size, plan.mesh.dp, pm.dp_rank, seed=args.seed)
    metrics = Metrics(plan, path=args.metrics, rank=rank)
    losses = []
    for step in range(args.steps):
        inputs, targets = batches.batch(step)
        lr = pm.optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        loss = pm.train_step(inputs, targets)
        # every rank's step time (a straggler shows here), on the device the backend moves
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=pm.device)
        rank_times = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rank_times, mine)
        rank_times = [float(t.item()) for t in rank_times]
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
        metrics.record(step, loss=loss, step_time_s=max(rank_times), rank_times=rank_times,
                       grad_norm=pm.last_grad_norm, lr=lr, peak_memory_bytes=peak)
        losses.append(loss)
        if rank == 0 and not args.quiet:
            print(f"step {step:5d}  loss {loss:.6f}  grad norm {pm.last_grad_norm:.4g}  lr {lr:.3g}  "
                  f"{max(rank_times) * 1e3:.1f} ms", flush=True)
    if rank == 0:
        print(metrics.summary(), flush=True)
        if args.losses_out:
            with open(args.losses_out, "w") as f:
                json.dump(losses, f)
    metrics.close()
    dist.destroy_process_group()
    return 0
