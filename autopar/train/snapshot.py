"""Snapshots of a training run, with torch.distributed.checkpoint (DCP), loadable under any plan.

    ckpt/
      step-00000010/            complete: DCP's shards and .metadata, then autopar.json
      step-00000015.partial/    being written (or cut off): never loaded, removed on the next save

What a snapshot holds: `ParallelModel.sharded_state_dict()` (parameters,
persistent buffers and optimizer state under the user's names, as DTensor
shards or whole tensors, so DCP reshards them onto any other plan or world
size), every rank's RNG state, and autopar.json (the step, the data order,
the learning-rate schedule's position, the loss scale, the layout it was saved
on). The data position is the step itself (`data.GlobalBatches`).

Why it is never half-loaded: every rank writes into `step-N.partial`; DCP's
coordinator writes .metadata only after all ranks' writes returned; then rank 0
writes autopar.json and renames the directory to `step-N` (one atomic rename),
and only such directories count. A crash at any moment leaves the previous
complete snapshot as the newest one.

Nothing loaded is unpickled beyond plain data: DCP's tensors are read with
`torch.load(weights_only=True)`, and its .metadata file (a pickle) through an
unpickler that admits only DCP's metadata classes (`SafeFileSystemReader`).
"""
from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.errors import AutoparError
from autopar.lower import state_dict as lsd

FORMAT, VERSION = "autopar-snapshot", 1
META = "autopar.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata, and nothing else: its dataclasses, torch.Size, dtypes, paths."""

    _ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
                ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED or (
                module == "torch.distributed.checkpoint.metadata" and not name.startswith("_")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"snapshot metadata refers to {module}.{name}, which a DCP snapshot "
                                     "never holds: not loading it")


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# -- the directory ---------------------------------------------------------
def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def complete(root: str) -> list[tuple[int, str]]:
    """(step, path) of every complete snapshot under root, oldest first."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and is_snapshot(path):
            out.append((int(m.group(1)), path))
    return sorted(out)


def latest(root: str) -> str | None:
    snaps = complete(root)
    return snaps[-1][1] if snaps else None


def is_snapshot(path: str) -> bool:
    """A complete step directory: DCP's .metadata and autopar.json are written after every shard."""
    return os.path.isfile(os.path.join(path, META)) and os.path.isfile(os.path.join(path, ".metadata"))


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise AutoparError(f"{path} is not a complete autopar snapshot ({exc})",
                           hint="pass a step-N directory written by train.py --save-dir, or the save dir itself")
    if meta.get("format") != FORMAT or meta.get("version", 0) > VERSION:
        raise AutoparError(f"{path}: snapshot format {meta.get('format')} v{meta.get('version')}, this autopar "
                           f"reads {FORMAT} v{VERSION} and older")
    return meta


def resolve(resume: str, save_dir: str | None) -> str | None:
    """--resume auto | never | PATH -> the snapshot directory to load, or None."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest(save_dir) if save_dir else None
    if is_snapshot(resume):
        return resume
    found = latest(resume)
    if found is None:
        raise AutoparError(f"--resume {resume}: no complete snapshot there",
                           hint="a step-N directory holding autopar.json, or a --save-dir that has one")
    return found


def _rng_key(rank: int, device: str) -> str:
    return f"rng.{device}.{rank}"


def _rng_states() -> dict[str, torch.Tensor]:
    out = {_rng_key(dist.get_rank(), "cpu"): torch.get_rng_state()}
    if torch.cuda.is_available():
        out[_rng_key(dist.get_rank(), "cuda")] = torch.cuda.get_rng_state()
    return out


# -- save ------------------------------------------------------------------
def save(pm, root: str, step: int, meta: dict, keep: int | None = None) -> str:
    """Write the snapshot after `step` optimizer steps (collective). Returns its path."""
    final = step_dir(root, step)
    partial = final + ".partial"
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for stale in os.listdir(root):  # cut-off writes of earlier runs (no one writes now)
            if stale.endswith(".partial"):
                shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    dist.barrier()
    state = pm.sharded_state_dict()
    state.update(_rng_states())
    dcp.save(state, storage_writer=dcp.FileSystemWriter(partial))
    if rank == 0:
        plan = pm.plan
        record = {"format": FORMAT, "version": VERSION, "step": step, "world_size": dist.get_world_size(),
                  "mesh": {"pp": plan.mesh.pp, "dp": plan.mesh.dp, "tp": plan.mesh.tp},
                  "model": plan.model.get("name"), "tied_aliases": getattr(pm, "tied_aliases", {}), **meta}
        if pm.grad_scaler is not None:  # fp16: the scale every rank holds alike
            record["loss_scaler"] = pm.grad_scaler.snapshot()
        if pm.lr_scheduler is not None:  # steps the schedule took: fewer than `step` when fp16 skipped some
            record["lr_scheduler"] = {"last_epoch": int(pm.lr_scheduler.last_epoch)}
        with open(os.path.join(partial, META), "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # --resume never over an old run: the new one wins
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_dir(root)
        if keep:
            for _, old in complete(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    dist.barrier()  # no rank goes on (or exits) before the snapshot is complete
    return final


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- load ------------------------------------------------------------------
def _saved_tensors(reader) -> dict[str, tuple]:
    md = reader.read_metadata()
    return {k: (tuple(v.size), v.properties.dtype) for k, v in md.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def check_model(pm, path: str, reader=None) -> dict:
    """The snapshot's saved tensors, once it is shown to hold this model (names, shapes):
    a snapshot of another model is named as such before anything else is compared."""
    saved = _saved_tensors(reader or SafeFileSystemReader(path))
    have = {k for k in saved if k.startswith(lsd.MODEL)}
    want = lsd.all_model_names(pm)
    if have != want:
        missing, extra = sorted(want - have), sorted(have - want)
        raise AutoparError(
            f"snapshot {path} holds another model: "
            + "; ".join(f"{what} {', '.join(k[len(lsd.MODEL):] for k in keys[:4])}"
                        + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
                        for what, keys in (("missing", missing), ("not in this model", extra)) if keys),
            hint="resume with the model the snapshot was trained with, or start a new --save-dir")
    for k, t in lsd.model_tensors(pm).items():
        if tuple(saved[k][0]) != tuple(t.shape):
            raise AutoparError(f"snapshot {path}: {k[len(lsd.MODEL):]} is {list(saved[k][0])}, "
                               f"this model's is {list(t.shape)}",
                               hint="resume with the model configuration the snapshot was trained with")
    return saved


def load(pm, path: str, saved: dict | None = None) -> dict:
    """Load a snapshot into this plan's shards (collective); returns its autopar.json.
    `saved`: what `check_model` returned for it, when the caller checked it already."""
    meta = read_meta(path)
    reader = SafeFileSystemReader(path)
    saved = saved if saved is not None else check_model(pm, path, reader)
    state = lsd.model_tensors(pm)
    targets, install = lsd.optimizer_targets(pm, saved)
    state.update(targets)
    same_ranks = meta.get("world_size") == dist.get_world_size() and meta.get("mesh") == {
        "pp": pm.plan.mesh.pp, "dp": pm.plan.mesh.dp, "tp": pm.plan.mesh.tp}
    rng = {}
    if same_ranks:  # each rank continues its own random stream (dropout masks as uninterrupted)
        rng = {k: torch.empty_like(v) for k, v in _rng_states().items() if k in saved}
        state.update(rng)
    state, restore = lsd.for_dcp(state)
    dcp.load(state, storage_reader=reader)
    restore()
    install()
    for k, v in rng.items():
        if ".cpu." in k:
            torch.set_rng_state(v)
        else:
            torch.cuda.set_rng_state(v)
    meta["rng_restored"] = bool(rng)
    if pm.grad_scaler is not None and meta.get("loss_scaler"):
        pm.grad_scaler.restore(meta["loss_scaler"])  # a snapshot of a bf16 / fp32 run: the configured start
    return meta


# -- export ----------------------------------------------------------------
def export_safetensors(full: dict[str, torch.Tensor], out: str, metadata: dict | None = None,
                       aliases: dict[str, str] | None = None) -> list[str]:
    """One file of the whole model's tensors, loadable without autopar (safetensors):
    a tied tensor under each of its names (`aliases`: name -> the name it is tied to),
    so `model.load_state_dict(load_file(out))` finds every key `state_dict()` has.
    Returns the names written."""
    from safetensors.torch import save_file

    full = {**full, **{a: full[to] for a, to in (aliases or {}).items() if to in full and a not in full}}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + ".partial"
    # safetensors refuses tensors sharing memory: each name gets its own copy (a tied pair, two)
    save_file({k: v.contiguous().clone() for k, v in full.items()}, tmp,
              metadata={k: str(v) for k, v in (metadata or {}).items()})
    os.replace(tmp, out)
    return sorted(full)


def snapshot_to_safetensors(path: str, out: str) -> list[str]:
    """Offline export of a snapshot's model (no process group, no plan): every
    model.* tensor read whole. Returns the tensor names written."""
    meta = read_meta(path)
    reader = SafeFileSystemReader(path)
    saved = _saved_tensors(reader)
    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in saved.items() if k.startswith(lsd.MODEL)}
    with warnings.catch_warnings():  # one process on purpose: DCP's "assuming ... a single process" says nothing new
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    full = {k[len(lsd.MODEL):]: v for k, v in sorted(state.items())}
    return export_safetensors(full, out, {"autopar_step": meta["step"], "model": meta.get("model")},
                              meta.get("tied_aliases"))
