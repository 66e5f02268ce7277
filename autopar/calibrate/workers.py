"""One calibration run: a process per rank (each rank benchmarks at the same
time as the others, its share of the machine), the phases in order with
progress, the result gathered from rank 0."""
from __future__ import annotations

import os
import socket
import time

import torch

from autopar.calibrate.communication import _collective, _group_sizes, measure_fsdp, measure_overlap
from autopar.calibrate.compute import measure_attention, measure_gemm, measure_gemm_unaligned, measure_ops, measure_optimizer
from autopar.calibrate.host_overhead import measure_dtensor_overhead, measure_overhead, measure_pipeline_action, measure_tp_collective_overhead
from autopar.calibrate.profile_file import build_profile
from autopar.calibrate.timing import SILENCE_LIMIT_S, Settings, Timer, grids, speed_probe
from cost_models.measured import Profile


def _worker(rank: int, world: int, port: int, settings: Settings, queue) -> None:
    """One rank of a calibration: host overheads, then (rank 0, or every CPU rank) the
    compute tables, then the communication every rank takes part in; rank 0 puts the
    result on `queue`, any rank its error."""
    import torch.distributed as dist

    try:
        device = _init_rank(rank, world, port, settings)
        barrier = dist.barrier if settings.device == "cpu" else None
        timer = Timer(settings, device, barrier)
        g = grids(settings)
        say = (lambda text: queue.put(("progress", text))) if rank == 0 else (lambda text: None)
        result: dict = {}
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        over = measure_overhead(timer, device)
        # DTensor's host time, on a one-rank mesh of each rank's own (every rank makes every group)
        one_rank = mesh if world == 1 else DeviceMesh.from_group(dist.new_subgroups(1)[0], device.type)
        over.update(measure_dtensor_overhead(timer, device, one_rank, eager=over))
        if settings.device == "cpu" or rank == 0:  # CPU ranks contend for the machine: all time together
            result.update(_compute_tables(timer, device, settings, g, over, mesh, barrier, say))
        _say_dtensor_overhead(over, say)
        dist.barrier()
        ctimer = Timer(settings, device, dist.barrier)
        if world == 1:  # one GPU (or one CPU process): compute only; collectives keep their physics
            fsdp = _one_rank_fsdp(ctimer, device, mesh, settings, say)
            if rank == 0:
                queue.put(("result", {**result, "collectives": {}, "funcol": 0.0, "fsdp": fsdp,
                                      "collective_overlap": None}))
            dist.destroy_process_group()
            return
        result["collectives"] = _collectives(ctimer, device, rank, world, g, say)
        result.update(_communication(ctimer, device, mesh, one_rank, settings, say))
        if rank == 0:
            queue.put(("result", result))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as exc:  # the parent reports it; a rank never hangs the others silently
        queue.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
        raise


def _init_rank(rank: int, world: int, port: int, settings: Settings) -> torch.device:
    """This rank's device (its GPU, or the CPU with its share of the threads), in the group."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if settings.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(settings.threads())
        device = torch.device("cpu")
    dist.init_process_group(settings.backend, rank=rank, world_size=world)
    return device


def _compute_tables(timer, device, settings: Settings, g: dict, over: dict, mesh, barrier, say) -> dict:
    """GEMMs, memory-bound ops, attention, unaligned GEMMs and the optimizer, timed
    between two speed probes (the machine's pace while they ran)."""
    say(f"host time per op: {over['fwd'] * 1e6:.1f} us forward, {over['bwd'] * 1e6:.1f} us backward")
    result: dict = {"overhead": over}
    probe_before = speed_probe(device, barrier=barrier)
    result["gemm"] = {dt: measure_gemm(timer, device, dt, g, over["no_grad"], say) for dt in settings.dtypes}
    result["bandwidth"] = measure_ops(timer, device, g, over["no_grad"], say)
    result["attention"] = measure_attention(timer, device, settings.dtypes, g, over, say)
    result["gemm_unaligned"] = {dt: measure_gemm_unaligned(timer, device, dt, over["no_grad"])
                                for dt in settings.dtypes}
    result["optimizer"] = measure_optimizer(timer, device, say, mesh)
    # the machine's pace while the compute tables were measured (see speed_probe)
    result["speed_probe_s"] = (probe_before + speed_probe(device, barrier=barrier)) / 2
    return result


def _say_dtensor_overhead(over: dict, say) -> None:
    say(f"DTensor host time per op: {over['dtensor_fwd'] * 1e6:.1f} us forward, "
        f"{over['dtensor_bwd'] * 1e6:.1f} us backward")
    if over.get("by_activation"):
        table = over["by_activation"]
        say("DTensor time per op by activation: " + ", ".join(
            f"{b / 2**10:.0f} KiB {f * 1e6:.0f}/{w * 1e6:.0f} us"
            for b, f, w in zip(table["bytes"], table["fwd_s"], table["bwd_s"])))


def _one_rank_fsdp(ctimer, device, mesh, settings: Settings, say):
    """autopar lowers a bf16 plan on one GPU through FSDP2's mixed precision: time that."""
    fsdp = measure_fsdp(ctimer, device, mesh, "bf16") if "bf16" in settings.dtypes else None
    if fsdp:
        say(f"FSDP2 (one rank, bf16 mixed precision) per small unit: {fsdp['gather_s'][0] * 1e6:.0f} us "
            f"per all-gather, {fsdp['reduce_s'][0] * 1e6:.0f} us per reduce-scatter")
    return fsdp


def _collectives(ctimer, device, rank: int, world: int, g: dict, say) -> dict:
    """{kind: {group size: {"bytes", "seconds"}}} over groups of the first n ranks; ranks
    outside a group time nothing but keep the barriers company."""
    import torch.distributed as dist

    coll: dict = {}
    for n in _group_sizes(world):
        group = dist.new_group(list(range(n)))
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "p2p"):
            if kind == "p2p" and n != 2:
                continue
            sizes, secs = [], []
            for nbytes in g["coll_bytes"]:
                if rank < n:
                    fn = _collective(kind, nbytes, group, n, rank, device)
                else:
                    fn = lambda: None  # noqa: E731  (outside the group: keep the barriers company)
                t = ctimer(fn, inner=max(1, min(20, 2**22 // nbytes)))
                sizes.append(float(nbytes))
                secs.append(t / 2 if kind == "p2p" else t)
            coll.setdefault(kind, {})[str(n)] = {"bytes": sizes, "seconds": secs}
        say(f"collectives over {n} ranks done")
    return coll


def _communication(ctimer, device, mesh, one_rank, settings: Settings, say) -> dict:
    """The host time around communication: a tp block's collectives, a pipeline action,
    FSDP2's units, and how much of a collective hides under compute."""
    result: dict = {}
    result["funcol"] = measure_tp_collective_overhead(ctimer, device, mesh, one_rank)
    say(f"a tensor-parallel block's collective costs {result['funcol'] * 1e6:.0f} us beyond a plain one")
    result["pipeline_action"] = measure_pipeline_action(ctimer, device)
    say(f"pipeline schedule host time per action: {result['pipeline_action'] * 1e6:.0f} us")
    result["fsdp"] = measure_fsdp(ctimer, device, mesh)
    say(f"FSDP2 per small unit: {result['fsdp']['gather_s'][0] * 1e6:.0f} us per all-gather, "
        f"{result['fsdp']['reduce_s'][0] * 1e6:.0f} us per reduce-scatter, collectives included")
    result["collective_overlap"] = measure_overlap(ctimer, device, settings)
    say(f"collective hidden under compute: {result['collective_overlap']:.0%}")
    return result



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def calibrate(settings: Settings, progress=None, runs: int = 1) -> Profile:
    """Run every measurement on `settings.ranks` processes and return the profile.
    `runs` > 1: calibrate that many times, every number the median of its runs
    (`cost_models.measured.median_profile`: a shared machine's slow spells)."""
    if runs > 1:
        from cost_models.measured import median_profile

        say = progress or (lambda text: None)
        profiles = []
        for i in range(runs):
            say(f"calibration run {i + 1} of {runs}")
            profiles.append(calibrate(settings, progress))
        return median_profile(profiles)
    return _calibrate_once(settings, progress)



def _calibrate_once(settings: Settings, progress=None) -> Profile:
    import torch.multiprocessing as mp

    progress = progress or (lambda text: None)
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is visible to torch")
    if settings.device == "cuda" and settings.ranks > torch.cuda.device_count():
        raise RuntimeError(f"--ranks {settings.ranks}: only {torch.cuda.device_count()} GPUs are visible")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, settings.ranks, port, settings, queue), daemon=True)
             for r in range(settings.ranks)]
    for p in procs:
        p.start()
    result, error = None, None
    heard = time.monotonic()
    while result is None and error is None:
        try:
            kind, payload = queue.get(timeout=5)
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                error = "a calibration rank exited early (exit codes " + \
                        ", ".join(str(p.exitcode) for p in procs) + ")"
            elif time.monotonic() - heard > SILENCE_LIMIT_S:  # a stuck collective: say so, never hang
                error = f"no rank reported for {SILENCE_LIMIT_S:.0f} s (a collective that never completed?)"
            continue
        heard = time.monotonic()
        if kind == "progress":
            progress(payload)
        elif kind == "error":
            error = payload
        else:
            result = payload
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    if error:
        raise RuntimeError(f"calibration failed: {error}")
    return build_profile(result, settings)

