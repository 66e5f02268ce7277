"""`autopar export`: a training snapshot's model as one safetensors file.

    autopar export ckpt/                 -> the newest complete snapshot in ckpt/
    autopar export ckpt/step-00000020 -o model.safetensors

Runs offline on one process, whatever plan and world size wrote the snapshot:
torch.distributed.checkpoint reads each tensor whole from its shards. The file
holds the model's parameters and persistent buffers under the model's own names
(what `model.state_dict()` calls them), so `load_state_dict(safetensors.torch.load_file(...))`
restores an unparallelised copy; nothing in it is pickled.
"""
from __future__ import annotations

import argparse
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("snapshot", metavar="SNAPSHOT",
                   help="a step-N directory written by train.py --save-dir, or the save dir (its newest one)")
    p.add_argument("-o", "--output", metavar="FILE.safetensors", default="model.safetensors",
                   help="where to write the model (default: model.safetensors)")


def run(args) -> int:
    from autopar.errors import AutoparError
    from autopar.train import snapshot

    if not os.path.isdir(args.snapshot):
        raise AutoparError(f"{args.snapshot}: no such directory",
                           hint="pass a step-N directory written by train.py --save-dir, or the save dir itself")
    path = args.snapshot if snapshot.is_snapshot(args.snapshot) else snapshot.latest(args.snapshot)
    if path is None:
        raise AutoparError(f"{args.snapshot} holds no complete snapshot",
                           hint="snapshots still being written end in .partial and are never read")
    names = snapshot.snapshot_to_safetensors(path, args.output)
    meta = snapshot.read_meta(path)
    print(f"wrote {args.output}: {len(names)} tensors of {meta.get('model') or 'the model'} at step {meta['step']} "
          f"(from {path})")
    return 0
