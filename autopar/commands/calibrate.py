"""`autopar calibrate -o profile.json`: time this machine (GEMMs, memory-bound ops,
attention, per-op host time, collectives) and write a measured profile that
`autopar plan / report / compile --profile profile.json` price plans with.

See autopar/calibrate/ (its __init__) for what is timed and cost_models/measured.py for how
the cost model reads it.
"""
from __future__ import annotations

import argparse
import os
import sys

from autopar.errors import AutoparError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", required=True, metavar="FILE", help="profile to write (JSON)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="what training runs on: CPU ranks over gloo, or GPUs over NCCL (default cpu)")
    parser.add_argument("--ranks", type=int, default=None, metavar="N",
                        help="ranks per node training will run (CPU: they share the cores and are timed "
                             "together; default 2) / GPUs to time collectives over (default: all visible). "
                             "One rank times compute only; collectives then keep the link's physics")
    parser.add_argument("--threads-per-rank", type=int, default=None, metavar="T",
                        help="CPU threads each rank uses (default: cores / ranks)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="GEMM dtypes to time, comma-separated (default fp32,bf16)")
    parser.add_argument("--quick", action="store_true", help="a small grid: a first look in seconds, not minutes")
    parser.add_argument("--runs", type=int, default=1, metavar="N",
                        help="calibrate N times and keep every measurement's median: a shared machine "
                             "(a VM, a node with neighbours) has slow spells one run can land in (default 1)")


def run(args) -> int:
    import torch

    from autopar.calibrate import DTYPES, Settings, calibrate

    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder):
        raise AutoparError(f"-o {args.output}: folder {folder} does not exist", hint="create it first")
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    unknown = [d for d in dtypes if d not in DTYPES]
    if not dtypes or unknown:
        raise AutoparError(f"--dtypes {args.dtypes}: unknown dtype(s) {', '.join(unknown) or '(none given)'}",
                           hint=f"choose from {', '.join(DTYPES)}")
    ranks = args.ranks
    if ranks is None:
        ranks = max(1, torch.cuda.device_count()) if args.device == "cuda" else 2
    if ranks < 1:
        raise AutoparError(f"--ranks must be positive, got {ranks}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda: torch sees no CUDA device", hint="calibrate CPU ranks with --device cpu")
    if args.device == "cuda" and ranks > torch.cuda.device_count():
        raise AutoparError(f"--ranks {ranks}: only {torch.cuda.device_count()} GPU(s) visible")
    if args.runs < 1:
        raise AutoparError(f"--runs must be positive, got {args.runs}")
    if args.threads_per_rank is not None and args.threads_per_rank < 1:
        raise AutoparError(f"--threads-per-rank must be positive, got {args.threads_per_rank}")
    settings = Settings(device=args.device, ranks=ranks, threads_per_rank=args.threads_per_rank, dtypes=dtypes,
                        quick=args.quick)
    print(f"calibrating {args.device} ({ranks} ranks, backend {settings.backend}"
          + (f", {settings.threads()} threads each" if args.device == "cpu" else "") + ")", file=sys.stderr)
    try:
        profile = calibrate(settings, progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True),
                            runs=args.runs)
    except RuntimeError as exc:
        raise AutoparError(str(exc), hint="rerun with --quick to check the setup; AUTOPAR_DEBUG=1 for details") from None
    profile.save(args.output)
    print(summary(profile, args.output))
    return 0


def summary(profile, path: str) -> str:
    dev = profile.device
    lines = [f"wrote {path}: device '{profile.device_name}'"]
    lines.append("  GEMM peak: " + ", ".join(f"{dt} {v * 1e3:.1f} GFLOP/s" if v < 1 else f"{dt} {v:.1f} TFLOP/s"
                                             for dt, v in sorted(dev["peak_tflops"].items())))
    lines.append(f"  memory-bound ops: up to {dev['memory_bandwidth_tbs'] * 1e3:.1f} GB/s; host time per op "
                 f"{profile.compute.op_overhead_fwd_s * 1e6:.1f} us forward, "
                 f"{profile.compute.op_overhead_bwd_s * 1e6:.1f} us backward")
    for tier, coll in sorted(profile.collectives.items()):
        fit = coll.fit("all_reduce")
        if fit:
            lines.append(f"  {tier} all-reduce: {fit[1] / 1e9:.2f} GB/s bus bandwidth, {fit[0] * 1e6:.1f} us per step")
    lines.append(f"use it: autopar plan MODEL --gpus N --device {'cpu' if dev['vendor'] == 'cpu' else 'NAME'} "
                 f"--profile {path}")
    return "\n".join(lines)
