"""The lowering matrix: every architecture x layout, lowered by autopar on CPU
gloo ranks, against one process training the same model (issue 12).

    python3 benchmarks/lowering_matrix/run.py [--arch A,B] [--layout L,M] [--out benchmarks/results]
        [--snapshot [--rev REV]]   run against `git archive REV` of autopar/ (edits during the run do not leak in)
        [--merge]                  replace only the cells run in an existing lowering_matrix.json
        [--report-only]            rewrite the .md from the .json (e.g. after editing CAUSES)

The baseline in benchmarks/results/ was made with `--snapshot --rev a82ebdf` (then --merge re-runs,
listed in the .md). A full run takes about 30 min on 2 busy cores.

Each cell builds the plan (`plan_for_model` for the fixed layouts,
`autopar.plan` on a CPU cluster of 4 in fp32 for "planner", and with pp=2, tp=2 pinned
for "planner_pp_tp"), lowers it with
`autopar.compile(plan=...)`, trains 3 SGD (lr 0.5, momentum 0.9) steps on 3
global batches of 8 and compares the loss at every step and every parameter
(`full_state_dict`) with one process training the same model on the same
batches the way the user would (`model(*x, labels=y).loss`, or
`loss_fn(output, y)`). A cell is

  pass      losses and parameters within 1e-5 relative (per tensor:
            max|p - ref| / max(max|ref|, 1e-3); the floor covers parameters
            whose reference gradient is zero, e.g. zero-initialised biases)
  refused   an AutoparError raised before training (planning or compile),
            with the same message on every rank
  mismatch  ran, but the numbers differ (worst loss / parameter recorded)
  crash     an exception (or a refusal not shared by every rank, or raised
            while training); first line and where it arose
  abort     a rank process died
  hang      no rank finished the cell within --cell-timeout

One spawned world per (arch, world size) runs its layouts in sequence; after
each cell the ranks meet at the TCP store (not a collective, so a rank stuck
in a collective cannot confuse it) and go on only if every rank ended the cell
the same way (all ran, all refused, all raised). A hang, an abort or a split
outcome kills the world, records the cell, and a new world runs the rest.
Every process started is killed before exit.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import multiprocessing as mp
import os
import pickle
import queue
import re
import signal
import socket
import subprocess
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.abspath(os.path.join(HERE, "..", ".."))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

GLOBAL_BATCH = 8
STEPS = 3
LR, MOMENTUM = 0.5, 0.9
TOL = 1e-5
PARAM_FLOOR = 1e-3
DATA_SEED = 123
GRACE_S = 20.0  # after one rank raised, how long the others may take to report before counting as blocked

# name: (world size, plan_for_model keywords; None = the planner's choice)
LAYOUTS = {
    "dp": (2, dict(dp=2, micro_batch_size=4)),
    "zero3": (2, dict(dp=2, zero=3, num_micro_batches=2, micro_batch_size=2)),
    "tp": (2, dict(tp=2, micro_batch_size=8)),
    "tp_sp": (2, dict(tp=2, sequence_parallel=True, micro_batch_size=8)),
    "pp_1f1b": (2, dict(pp=2, schedule="1f1b", num_micro_batches=2, micro_batch_size=4)),
    "pp_interleaved": (2, dict(pp=2, schedule="interleaved", virtual_stages=2, num_micro_batches=4,
                               micro_batch_size=2)),
    "dp_tp": (4, dict(dp=2, tp=2, micro_batch_size=4)),
    "pp_dp": (4, dict(pp=2, dp=2, schedule="1f1b", num_micro_batches=2, micro_batch_size=2)),
    "pp_tp": (4, dict(pp=2, tp=2, schedule="1f1b", num_micro_batches=2, micro_batch_size=4)),
    # HSDP: ZeRO 3 over 2 shards, 2 replicas (Mesh.dp_shard), the replica all-reduce after 2 micro-batches
    "hsdp": (4, dict(dp=4, dp_shard=2, zero=3, num_micro_batches=2, micro_batch_size=1)),
    # expert parallelism (Mesh.ep): MoE experts over 2 ranks; over 2 of dp 4 (efsdp 2); beside a pipeline.
    # Dense architectures are refused before running (no MoE layer)
    "ep": (2, dict(dp=2, ep=2, zero=3, micro_batch_size=4)),
    "ep_dp": (4, dict(dp=4, ep=2, zero=3, micro_batch_size=2)),
    "ep_pp": (4, dict(pp=2, dp=2, ep=2, zero=2, schedule="1f1b", num_micro_batches=2, micro_batch_size=2)),
    # context parallelism (Mesh.cp): every sequence cut over 2 ranks, ring attention; with tp and with dp
    "cp": (2, dict(cp=2, micro_batch_size=8)),
    "cp_tp": (4, dict(cp=2, tp=2, micro_batch_size=8)),
    "cp_dp": (4, dict(cp=2, dp=2, micro_batch_size=4)),
    "planner": (4, None),
    "planner_pp_tp": (4, None),
}
# the planner's own layouts: autopar.plan with these pins (the rest is its choice)
PLANNER_PINS = {"planner": {}, "planner_pp_tp": {"pp": 2, "tp": 2}}
TP_PP = [n for n in LAYOUTS if "tp" in n or "pp" in n]
CODES = {"pass": "ok", "refused": "R", "mismatch": "**M**", "crash": "**C**", "abort": "**A**", "hang": "**H**"}
STATUSES = list(CODES)


# ---------------------------------------------------------------------------------------------
# rank side
# ---------------------------------------------------------------------------------------------
def _short_path(filename: str) -> str:
    for marker in ("/autopar/", "/site-packages/", "/benchmarks/"):
        if marker in filename:
            return marker.strip("/") + "/" + filename.split(marker, 1)[1]
    return filename


def _where(exc: BaseException) -> dict:
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if "/autopar/" in f.filename]
    fmt = lambda f: f"{_short_path(f.filename)}:{f.lineno} ({f.name})"  # noqa: E731
    return {"autopar": fmt(own[-1]) if own else None, "innermost": fmt(frames[-1]) if frames else None,
            "autopar_stack": [fmt(f) for f in own[-4:]]}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _describe(plan) -> str:
    m = plan.mesh
    parts = [f"pp{m.pp} dp{m.dp} tp{m.tp}"]
    if plan.sequence_parallel:
        parts.append("sp")
    if m.pp > 1:
        parts.append(plan.schedule + (f"x{plan.virtual_stages}" if plan.virtual_stages > 1 else ""))
    zeros = sorted({c.zero for c in plan.layer_choices})
    ckpt = sorted({c.checkpoint for c in plan.layer_choices} - {"none"})
    parts.append("zero" + "/".join(map(str, zeros)))
    if ckpt:
        parts.append("ckpt " + "/".join(ckpt))
    parts.append(f"mb {plan.num_micro_batches}x{plan.micro_batch_size} {plan.precision}")
    return " ".join(parts)


def plan_only(arch_name: str, world: int, pins: dict) -> dict:
    """autopar.plan (CPU cluster of `world`, fp32) in a process with no process
    group, as `autopar plan` runs: what the planner is told the lowering runs
    (autopar/lower/what_runs.py) needs a fake group of its own."""
    from archs import ARCHS
    from autopar.errors import AutoparError
    from autopar.lower.model_layers import model_signature
    try:
        import autopar
        from autopar.solve.planner import scaled_cluster
        from cost_models.hardware import ClusterSpec
        spec = ARCHS[arch_name]()
        cluster = scaled_cluster(ClusterSpec.resolve("cpu"), 1, world)
        plan = autopar.plan(spec.model, cluster, example_inputs=spec.example_inputs,
                            global_batch_size=GLOBAL_BATCH, precision="fp32", constraints=pins or None)
        plan.model.setdefault("param_shapes", model_signature(spec.model)["param_shapes"])
        return {"plan": plan.to_dict()}
    except AutoparError as exc:
        return {"refused": str(exc)}
    except Exception as exc:
        return {"crash": _first_line(exc), "where": _where(exc)}


def _planner_plan(arch_name, world, pins):
    """The plan made by plan_only in a fresh process (rank 0 starts it), shared with every rank."""
    import torch.distributed as dist

    from autopar.errors import AutoparError
    from autopar.plan import Plan
    box = [None]
    if dist.get_rank() == 0:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--plan-only",
                               json.dumps([arch_name, world, pins])], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            box[0] = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            box[0] = {"crash": f"planner process exited {proc.returncode}: {proc.stderr.strip()[-300:]}",
                      "where": {"innermost": "plan_only"}}
    dist.broadcast_object_list(box, src=0)
    got = box[0]
    if "refused" in got:
        raise AutoparError(f"planner: {got['refused']}")
    if "crash" in got:
        raise RuntimeError(f"planner on rank 0 raised {got['crash']} at {got['where']['innermost']}")
    return Plan.from_dict(got["plan"])


def run_cell(arch_name: str, layout: str, batches, rank: int, world: int) -> dict:
    import torch
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from archs import ARCHS
    from autopar.errors import AutoparError
    from autopar.lower import compile as ap_compile
    from autopar.lower import plan_for_model

    t0 = time.time()
    phase = "build"
    try:
        spec = ARCHS[arch_name]()
        phase = "plan"
        if LAYOUTS[layout][1] is None:
            plan = _planner_plan(arch_name, world, PLANNER_PINS[layout])
        else:
            plan = plan_for_model(spec.model, example_inputs=spec.example_inputs, **LAYOUTS[layout][1])
        phase = "compile"
        pm = ap_compile(spec.model, example_inputs=spec.example_inputs, loss_fn=spec.loss_fn,
                        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": LR, "momentum": MOMENTUM}, plan=plan)
        phase = "train"
        losses = [pm.train_step(x, y) for x, y in batches]
        phase = "gather"
        state = pm.full_state_dict()
        tp_sharded = tp_sharded_blocks = 0
        if pm.plan.mesh.tp > 1:
            blocks = tuple(path + "." for c in pm.plan.layer_choices if c.tp_style in ("colwise_rowwise", "sequence")
                           for path in c.module_paths)
            for name, p in pm._local_params().items():
                if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
                    # _StridedShard (MoE gate_up: each rank's slice of gate and of up) is no Shard subclass
                    if isinstance(p.placements[p.device_mesh.mesh_dim_names.index("tp")], (Shard, _StridedShard)):
                        tp_sharded += 1
                        tp_sharded_blocks += name.startswith(blocks)
        return {"status": "ran", "losses": [float(x) for x in losses],
                "state": {k: v.detach().cpu() for k, v in state.items()} if rank == 0 else None,
                "notes": list(pm.notes), "layout": _describe(pm.plan), "loss_parallel": bool(pm.loss_parallel),
                "tp_sharded": tp_sharded, "tp_sharded_blocks": tp_sharded_blocks, "seconds": time.time() - t0}
    except AutoparError as exc:
        if phase in ("plan", "compile"):
            return {"status": "refused", "message": _first_line(exc), "full": str(exc)[:2000], "phase": phase,
                    "where": _where(exc), "seconds": time.time() - t0}
        return {"status": "raised", "message": _first_line(exc), "phase": phase, "where": _where(exc),
                "traceback": traceback.format_exc()[-4000:], "seconds": time.time() - t0}
    except Exception as exc:
        return {"status": "raised", "message": _first_line(exc), "phase": phase, "where": _where(exc),
                "traceback": traceback.format_exc()[-4000:], "seconds": time.time() - t0}


def rank_main(rank, world, port, arch_name, cells, batches, cell_timeout, log_path, results):
    # Each rank's own output goes to a log file (gloo's abort text lands there).
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    batches = pickle.loads(batches)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        store = dist.distributed_c10d._get_default_store()
        for i, layout in enumerate(cells):
            print(f"=== cell {i}: {arch_name} / {layout}", flush=True)
            out = run_cell(arch_name, layout, batches, rank, world)
            if out["status"] == "raised":
                print(out["traceback"], flush=True)
            results.put((rank, i, pickle.dumps(out)))  # bytes: no shared-memory tensors to outlive the rank
            # Meet at the store: go on only if every rank ended this cell the same way.
            store.set(f"cell{i}/rank{rank}", out["status"])
            store.wait([f"cell{i}/rank{r}" for r in range(world)], _dt.timedelta(seconds=cell_timeout))
            ends = {store.get(f"cell{i}/rank{r}").decode() for r in range(world)}
            if len(ends) != 1:
                print(f"ranks ended cell {i} differently ({sorted(ends)}): leaving", flush=True)
                break
    except BaseException:
        print(traceback.format_exc(), flush=True)
    finally:
        results.put((rank, None, None))
        results.close()
        results.join_thread()
        sys.stdout.flush()
        os._exit(0)  # skip interpreter teardown: gloo can abort there


# ---------------------------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------------------------
_LIVE: list = []


def _kill_all(*_):
    for p in list(_LIVE):
        try:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        except Exception:
            pass
    _LIVE.clear()


def _on_signal(signum, frame):
    _kill_all()
    raise SystemExit(128 + signum)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_batches(arch_name: str):
    import torch

    from archs import ARCHS
    spec = ARCHS[arch_name]()
    g = torch.Generator().manual_seed(DATA_SEED)
    out = []
    for _ in range(STEPS):
        x = spec.example_inputs(GLOBAL_BATCH, generator=g)
        out.append((tuple(x), spec.targets_fn(x, g)))
    return out


def reference(arch_name: str, batches, perturb: float = 0.0):
    """One process, no autopar: the user's training loop. `perturb`: every weight
    first multiplied by (1 + perturb * noise), a rounding-sized nudge (see `sensitivity`)."""
    import torch

    from archs import ARCHS, reference_loss
    spec = ARCHS[arch_name]()
    model = spec.model
    if perturb:
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                # a rounding-sized nudge in the parameter's own dtype (fp64 architectures: 1e-16)
                scale = torch.finfo(p.dtype).eps / torch.finfo(torch.float32).eps
                p.mul_(1 + perturb * scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = reference_loss(spec, model, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


PERTURB = 1e-7  # about fp32's rounding (2^-24 = 6e-8)


def sensitivity(ref, perturbed) -> float:
    """How far one process lands from itself when its weights are nudged by a
    rounding error: the worst parameter's relative difference after the same
    steps. A well-conditioned model stays near 1e-6; ResNet's BatchNorm over
    8 samples (2 x 2 pixels in its last stage) lands 0.2 away, so no
    distributed run can be held to 1e-5 there. Parameters are judged against
    max(TOL, 2 x this); losses always against TOL."""
    return max((p.float() - perturbed[1][k].float()).abs().max().item() / max(p.abs().max().item(), PARAM_FLOOR)
               for k, p in ref[1].items())


def _rel(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def compare(out0: dict, per_rank: list[dict], ref) -> dict:
    ref_losses, ref_params = ref[:2]
    rec = {"losses": out0["losses"], "ref_losses": ref_losses}
    rec["loss_rel"] = max(_rel(a, b) for a, b in zip(out0["losses"], ref_losses))
    rec["ranks_agree"] = all(r["losses"] == out0["losses"] for r in per_rank)
    state = out0["state"]
    missing, extra = sorted(set(ref_params) - set(state)), sorted(set(state) - set(ref_params))
    worst, worst_name, worst_abs = 0.0, None, 0.0
    for k, ref_p in ref_params.items():
        if k not in state:
            continue
        p = state[k]
        if tuple(p.shape) != tuple(ref_p.shape):
            rel, diff = math.inf, math.inf
        else:
            diff = (p.float() - ref_p.float()).abs().max().item()
            rel = diff / max(ref_p.abs().max().item(), PARAM_FLOOR)
            rel = math.inf if not math.isfinite(rel) else rel
        if rel > worst or worst_name is None:
            worst, worst_name, worst_abs = rel, k, diff
    rec.update(param_rel=worst, worst_param=worst_name, worst_param_abs=worst_abs)
    if missing or extra:
        rec["param_names"] = {"missing": missing[:5], "extra": extra[:5]}
    param_tol = max(TOL, 2 * ref[2]) if len(ref) > 2 else TOL
    rec["param_tol"] = param_tol
    ok = rec["loss_rel"] <= TOL and worst <= param_tol and rec["ranks_agree"] and not missing and not extra
    rec["status"] = "pass" if ok else "mismatch"
    return rec


def classify(outs: dict[int, dict], world: int, ref) -> dict:
    per_rank = [outs[r] for r in range(world)]
    statuses = [o["status"] for o in per_rank]
    seconds = max(o.get("seconds", 0) for o in per_rank)
    if all(s == "ran" for s in statuses):
        rec = compare(per_rank[0], per_rank, ref)
        rec.update(layout_run=per_rank[0]["layout"], notes=per_rank[0]["notes"],
                   loss_parallel=per_rank[0]["loss_parallel"],
                   # summed over ranks: with a pipeline, rank 0 may hold no block (the embedding alone)
                   tp_sharded=sum(o["tp_sharded"] for o in per_rank),
                   tp_sharded_blocks=sum(o.get("tp_sharded_blocks") or 0 for o in per_rank))
    elif all(s == "refused" for s in statuses) and len({o["message"] for o in per_rank}) == 1:
        o = per_rank[0]
        rec = {"status": "refused", "message": o["message"], "full": o["full"], "phase": o["phase"],
               "where": o["where"]}
    else:
        bad = next((r, o) for r, o in enumerate(per_rank) if o["status"] != "ran")
        r, o = bad
        rec = {"status": "crash", "message": o["message"], "phase": o["phase"], "where": o["where"],
               "rank": r, "rank_statuses": statuses, "traceback": o.get("traceback", "")}
        if all(s == "refused" for s in statuses):
            rec["detail"] = "refused on every rank with different messages"
        elif "refused" in statuses:
            rec["detail"] = "refused on some ranks only"
    rec["seconds"] = round(seconds, 1)
    return rec


def _log_tail(path: str, n: int = 6) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [l.rstrip() for l in f if l.strip()]
        return " | ".join(lines[-n:])[-800:]
    except OSError:
        return ""


def run_world(arch_name, world, cells, batches, ref, cell_timeout, log_dir, progress, attempt):
    """Run `cells` in one spawned world; returns (records for a prefix of cells, number consumed)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    logs = [os.path.join(log_dir, f"{arch_name}_w{world}_{attempt}_rank{r}.log") for r in range(world)]
    blob = pickle.dumps(batches)
    procs = [ctx.Process(target=rank_main, args=(r, world, port, arch_name, cells, blob, cell_timeout,
                                                 logs[r], results), daemon=True) for r in range(world)]
    _LIVE.extend(procs)
    for p in procs:
        p.start()
    records: list[dict] = []
    reports: dict[int, dict[int, dict]] = {}
    exited: set[int] = set()
    current = 0
    start = time.monotonic()
    cell_start, first_error = start, None
    spawn_allowance = 90.0  # the first cell also pays for spawning and importing
    try:
        while current < len(cells):
            try:
                rank, i, out = results.get(timeout=1.0)
                out = pickle.loads(out) if out is not None else None
                if i is None:
                    exited.add(rank)
                else:
                    reports.setdefault(i, {})[rank] = out
                    if out["status"] != "ran" and first_error is None:  # raised, or refused
                        first_error = time.monotonic()
            except queue.Empty:
                pass
            now = time.monotonic()
            if len(reports.get(current, {})) == world:
                rec = classify(reports[current], world, ref)
                records.append(rec)
                progress(cells[current], rec)
                ends = {o["status"] for o in reports[current].values()}
                current += 1
                cell_start, first_error = now, None
                if len(ends) != 1:  # the ranks leave this world
                    break
                continue
            got = reports.get(current, {})
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in got]
            if dead:
                time.sleep(1.0)  # a result may still be in flight
                while True:
                    try:
                        rank, i, out = results.get_nowait()
                    except queue.Empty:
                        break
                    out = pickle.loads(out) if out is not None else None
                    if i is None:
                        exited.add(rank)
                    else:
                        reports.setdefault(i, {})[rank] = out
                if len(reports.get(current, {})) == world:
                    continue
                got = reports.get(current, {})
                dead = [r for r in dead if r not in got]
                if dead:
                    codes = [procs[r].exitcode for r in dead]
                    rec = {"status": "abort", "message": f"rank(s) {dead} died (exit codes {codes})",
                           "log_tail": {r: _log_tail(logs[r]) for r in dead},
                           "others": {r: (o["status"], o.get("message")) for r, o in got.items()},
                           "seconds": round(now - cell_start, 1)}
                    # an exception on a surviving rank is the likelier first cause: keep it
                    records.append(rec)
                    progress(cells[current], rec)
                    current += 1
                    break
            limit = cell_timeout + (spawn_allowance if current == 0 else 0)
            if first_error is not None and now - first_error > min(GRACE_S, cell_timeout):
                r, o = next((r, o) for r, o in sorted(got.items()) if o["status"] != "ran")
                blocked = sorted(set(range(world)) - set(got))
                how = "refused on rank(s) " + str(sorted(q for q, x in got.items() if x["status"] == "refused")) + \
                    " only; " if o["status"] == "refused" else ""
                rec = {"status": "crash", "message": o["message"], "phase": o["phase"], "where": o["where"],
                       "rank": r, "traceback": o.get("traceback", ""),
                       "detail": f"{how}rank(s) {blocked} blocked (killed)",
                       "seconds": round(now - cell_start, 1)}
                records.append(rec)
                progress(cells[current], rec)
                current += 1
                break
            if now - cell_start > limit:
                rec = {"status": "hang", "message": f"no result from rank(s) {sorted(set(range(world)) - set(got))} "
                                                    f"after {limit:.0f} s",
                       "others": {r: (o["status"], o.get("message")) for r, o in got.items()},
                       "log_tail": {r: _log_tail(logs[r], 3) for r in range(world) if r not in got},
                       "seconds": round(now - cell_start, 1)}
                records.append(rec)
                progress(cells[current], rec)
                current += 1
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=3 if current >= len(cells) else 0.1)
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
            if p in _LIVE:
                _LIVE.remove(p)
        results.close()
        results.cancel_join_thread()
    return records, current


def run_arch(arch_name, layouts, cell_timeout, log_dir, progress):
    import torch
    torch.manual_seed(0)
    batches = make_batches(arch_name)
    ref = reference(arch_name, batches)
    ref = (*ref, sensitivity(ref, reference(arch_name, batches, PERTURB)))
    out = {}
    if not all(math.isfinite(x) for x in ref[0]):
        for l in layouts:
            out[l] = {"status": "crash", "message": f"reference losses not finite: {ref[0]}", "seconds": 0}
        return out
    by_world: dict[int, list[str]] = {}
    for l in layouts:
        by_world.setdefault(LAYOUTS[l][0], []).append(l)
    for world, cells in by_world.items():
        attempt = 0
        while cells:
            records, used = run_world(arch_name, world, cells, batches, ref, cell_timeout, log_dir,
                                      lambda layout, rec: progress(arch_name, layout, world, rec), attempt)
            for l, rec in zip(cells, records):
                rec["world"] = world
                out[l] = rec
            cells = cells[max(used, 1):]
            attempt += 1
    return out


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _git_state() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return ""
    import autopar
    path = os.path.dirname(autopar.__file__)
    snap = not path.startswith(REPO)
    commit = git("rev-parse", "HEAD")
    if snap and os.path.exists(os.path.join(path, "..", "COMMIT")):
        with open(os.path.join(path, "..", "COMMIT")) as f:
            commit = f.read().strip()
    return {"commit": commit, "snapshot_of_head": snap,
            "dirty_autopar": "" if snap else git("status", "--short", "--", "autopar", "cost_models"),
            "autopar_path": path}


def _snapshot(rev: str = "HEAD") -> str:
    """Extract `rev`'s autopar/ and cost_models/ to a temp dir and put it first on the import path."""
    import tarfile
    import tempfile
    if "autopar" in sys.modules:
        raise SystemExit("--snapshot must be set before autopar is imported")
    dest = tempfile.mkdtemp(prefix="lowering_matrix_src_")
    tar = os.path.join(dest, "src.tar")
    commit = subprocess.run(["git", "rev-parse", "--verify", rev + "^{commit}"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.strip()
    subprocess.run(["git", "archive", "--format=tar", "-o", tar, commit, "autopar", "cost_models"], cwd=REPO,
                   check=True)
    with open(os.path.join(dest, "COMMIT"), "w") as f:
        f.write(commit)
    with tarfile.open(tar) as t:
        t.extractall(dest)
    os.remove(tar)
    sys.path.insert(0, dest)
    os.environ["PYTHONPATH"] = dest + os.pathsep + os.environ.get("PYTHONPATH", "")  # the spawned ranks too
    return dest


def _versions() -> dict:
    import torch
    v = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import transformers
        v["transformers"] = transformers.__version__
    except ImportError:
        v["transformers"] = None
    return v


def _cell_text(rec: dict) -> str:
    s = rec["status"]
    if s == "pass":
        return ""
    if s == "mismatch":
        extra = f"; ranks disagree" if not rec.get("ranks_agree", True) else ""
        names = f"; parameter names differ {rec['param_names']}" if rec.get("param_names") else ""
        return (f"loss rel {rec['loss_rel']:.2e}, param rel {rec['param_rel']:.2e} (worst `{rec['worst_param']}`)"
                f"{extra}{names}; losses {['%.5f' % x for x in rec['losses']]} vs "
                f"{['%.5f' % x for x in rec['ref_losses']]}")
    text = rec.get("message", "")
    where = rec.get("where") or {}
    loc = where.get("autopar") or where.get("innermost")
    if loc:
        text += f" — at `{loc}`"
        if where.get("innermost") and where.get("innermost") != loc:
            text += f" (innermost `{where['innermost']}`)"
    if rec.get("phase"):
        text += f" [phase {rec['phase']}]"
    if rec.get("detail"):
        text += f" [{rec['detail']}]"
    if rec.get("log_tail"):
        text += f" log: {json.dumps(rec['log_tail'])[:400]}"
    if rec.get("others"):
        text += f" others: {json.dumps(rec['others'])[:300]}"
    return text


# ---------------------------------------------------------------------------------------------
# root causes: each failing cell is matched to the first cause whose symptom it shows. The code
# locations were read in autopar at a82ebdf (the baseline); a cause that still matches after a fix
# shows the same symptom, not necessarily the same line.
# ---------------------------------------------------------------------------------------------
OWN_LOSS_NOT_CAUSAL = {"bert", "roberta", "electra", "distilbert", "t5", "bart"}


def _msg(c):
    return f"{c.get('message', '')} {c.get('detail', '')} {json.dumps(c.get('log_tail', ''))}"


CAUSES = [
    dict(id="batchnorm-rounding",
         title="ResNet with BatchNorm over 8 samples: rounding amplified, not a lowering difference",
         match=lambda c, g: c["status"] == "mismatch" and c["arch"] == "resnet_bn" and c.get("loss_rel", 1) <= TOL,
         where="lower/batch_norm.py normalises over the dp group with two-pass fp32 sums; in ONE process (a dp "
               "group of 1, no distribution) that arithmetic against torch's own BatchNorm kernel ends the same "
               "3 steps at lr 0.5 5.8e-3 apart (batch_norm.synchronise on a gloo world of one rank, the matrix's "
               "batches), more than the dp run's 3.2e-3; one step's dp gradients agree to 3.5e-6, every loss to 8e-7",
         fix="the architecture runs in fp64 since 5c90948+ (archs_issue29.resnet_bn): the dp run then matches to "
             "1.3e-11, while per-rank statistics (the sync switched off) end 2.4 off; BatchNorm statistics of an "
             "fp64 input were taken in fp32 (3e-5 off), now in the input's dtype"),
    dict(id="own-loss-shifted",
         title="loss_fn=None on a non-causal transformers model scores shifted labels",
         match=lambda c, g: c["status"] == "mismatch" and c["arch"] in OWN_LOSS_NOT_CAUSAL,
         where="lower/model_io.py:102-109 resolve_loss_fn wraps any `model.loss_function` in HFCausalLMLoss, "
               "whose scored_tokens (:131-134) counts `labels[..., 1:]` and sets num_items_in_batch from it "
               "(BertForMaskedLM's ForMaskedLMLoss scores unshifted labels: wrong normaliser); T5/BART's "
               "`loss_function` is ForCausalLMLoss (shifts) while their forward scores labels unshifted",
         fix="reproduce the forward's own loss per task (masked LM / seq2seq: no shift, count the unshifted "
             "labels; classification: CE over num_labels), or refuse loss_fn=None for anything else"),
    dict(id="own-loss-needs-vocab",
         title="loss_fn=None refused for a model without config.vocab_size (image classification)",
         match=lambda c, g: "needs loss_fn(logits, targets)" in c.get("message", ""),
         where="lower/model_io.py:102-106 resolve_loss_fn: the own loss only where config.vocab_size exists",
         fix="support ForImageClassification/ForSequenceClassification own losses (CE over num_labels), "
             "checked by the same probe as the LM losses"),
    dict(id="capture-meta-fp32",
         title="plan_for_model's capture fails on MoE experts (torch._grouped_mm meta kernel is bf16-only)",
         match=lambda c, g: "_grouped_mm" in c.get("message", ""),
         where="lower/manual_plan.py:54 `capture(model, example_inputs, dtype=torch.float32, seq_dim=None)` "
               "traces on meta; transformers' MoE experts call torch._grouped_mm, whose meta kernel accepts "
               "bf16 only (its CPU kernel runs fp32: one process trains; the planner captures in bf16)",
         fix="capture under FakeTensorMode with the real device's kernels, or retry an op in the plan's "
             "compute dtype when its meta kernel refuses fp32"),
    dict(id="enc-dec-block-stack",
         title="encoder-decoder: plan and lowering pick different block stacks",
         match=lambda c, g: "must be on the last pipeline stage" in c.get("message", "")
         or ("differently sharded ends" in c.get("message", "") and "shared.weight" in c.get("message", ""))
         or (c["arch"] == "torch_transformer" and "got mixed torch.Tensor and DTensor" in c.get("message", "")),
         where="capture puts the encoder's final norm into the last encoder block's paths; "
               "manual_plan.py:73 block_container counts those paths (encoder 3, decoder 4: the decoder "
               "stack is the blocks, encoder blocks become 'pre' layers styled 'vocab'), model_layers.py:99 "
               "drops parameter paths before :103 block_container (4 vs 4, tie -> the encoder). So decoder "
               "blocks are 'post' layers: pp refuses them off the last stage (pipeline_parallel.py:212), "
               "tp column-splits every Linear in them (tensor_parallel.py:226-235; nn.MultiheadAttention's "
               "out_proj weight is then a DTensor read functionally -> addmm mixed) and the tied "
               "`shared` embedding gets differently sharded ends (parallel_model.py:332)",
         fix="decide the block stack once and record it in the Plan; lower encoder-decoders as two block "
             "stacks (both tensor-parallel, pipeline cuts through encoder then decoder)"),
    dict(id="pp-prelayer-refusal-one-rank",
         title="pipeline: non-Embedding pre-block modules refused, and only on ranks holding a later stage",
         match=lambda c, g: "need a stand-in for pre-block module" in c.get("message", ""),
         where="pipeline_parallel.py:150-157 (StageModule.__init__) raises for a weighted pre module that is "
               "not nn.Embedding (BertEmbeddings, BLOOM's word_embeddings_layernorm); StageModule is built "
               "only for local stages at parallel_model.py:300, after init_distributed()/build_mesh (:281-282): "
               "pp_1f1b/pp_dp/pp_tp: pp rank 0 never refuses and blocks (crash); interleaved: every rank holds "
               "a later stage (clean refusal)",
         fix="run every stage's stand-in checks on every rank before init_distributed; then give later "
             "stages a generic stand-in for any pre module (zeros of the shape capture recorded), not only "
             "nn.Embedding"),
    dict(id="pp-standin-structure",
         title="pipeline stand-ins return a bare tensor and lack the block's attributes",
         match=lambda c, g: "pp" in c["layout"] and re.search(
             r"values to unpack|Input tensor rank|_SkipBlock' object has no attribute|_StopBlock' object has",
             c.get("message", "")) is not None,
         where="pipeline_parallel.py:46-52 _SkipBlock.forward returns the activation itself; models whose "
               "blocks return tuples read `outputs[0]` (GPT-J, Falcon, user code `x, _ = block(x)`) and get "
               "the first batch row; nn.TransformerEncoder.forward reads `self.layers[0].self_attn` "
               "(torch/nn/modules/transformer.py:452), which a _SkipBlock lacks",
         fix="stand-ins mirror the replaced block: same output structure (recorded by the probe: tuple with "
             "the activation at the same index, None elsewhere) and attribute access delegated to it"),
    dict(id="pp-tied-grad-placement",
         title="tied embedding/head across pipeline ranks under TP: gradient all-reduce of different sizes",
         match=lambda c, g: c["status"] == "abort" and c["layout"] == "pp_tp",
         where="parallel_model.py:148-152 _sync_tied_grads all-reduces `g._local_tensor`; the vocab-parallel "
               "embedding's gradient comes back Replicate() (128x32 on ex_gpt) while the head's is Shard(0) "
               "(64x32): gloo receives more bytes than posted and aborts the rank (measured with a probe at "
               "a82ebdf)",
         fix="redistribute each end's gradient to its parameter's placements before all-reducing the local "
             "tensor, and compare the ends' local shapes once at compile (before any step)"),
    dict(id="tied-end-plain-parameter",
         title="a tied parameter whose other end is a bare Parameter is refused under TP",
         match=lambda c, g: "differently sharded ends" in c.get("message", ""),
         where="parallel_model.py:322-332: ColwiseParallel replaces the head Linear's bias with a Shard(0) "
               "DTensor; the same Parameter held by the LM-head module itself (BertLMPredictionHead.bias, "
               "RobertaLMHead.bias) stays plain, so the re-tie refuses",
         fix="re-point every holder of a tied parameter at the sharded Parameter when the other holders are "
             "not modules with a style of their own; refuse only two differently styled modules"),
    dict(id="tp-position-embedding-split",
         title="TP vocab-splits a position embedding whose indices are computed in forward",
         match=lambda c, g: "aten.embedding.default got mixed" in c.get("message", ""),
         where="tensor_parallel.py:230-231 applies RowwiseParallel to every nn.Embedding of the embedding layer, "
               "including OPTLearnedPositionalEmbedding (positions computed from the attention mask inside "
               "its forward, modeling_opt.py:70): the plain index tensor meets the DTensor table",
         fix="vocab-split only the table fed by the token ids (num_embeddings == vocab size, found by data "
             "flow); replicate position tables"),
    dict(id="tp-inplace-on-local-output",
         title="TP: in-place add on a row-parallel output (a view returned by to_local)",
         match=lambda c, g: "_ToTorchTensor is a view" in c.get("message", ""),
         where="tensor_parallel.py:208-209 row-parallel Linears with use_local_output=True return "
               "DTensor.to_local(), a view made in a custom autograd Function; Falcon's "
               "`mlp_output += attention_output` (modeling_falcon.py:619) modifies it in place",
         fix="row-parallel outputs leave the region as a fresh tensor (or stay DTensor to the block exit)"),
    dict(id="tp-plain-tensor-in-region",
         title="TP region mixes DTensors with plain tensors (q/k norms, buffers, residual passed in)",
         match=lambda c, g: "got mixed torch.Tensor and DTensor" in c.get("message", ""),
         where="tensor_parallel.py:205 ReplicateModuleInputs turns every argument of a split sub-module into a "
               "DTensor (tp_styles.py:96-99) but the sub-module's other parameters and buffers stay plain "
               "(Qwen3/OLMo2 q_norm/k_norm weights, GPT-J's embed_positions buffer gathered with DTensor "
               "position_ids, a user's causal-mask buffer), and :208-209 makes the row-parallel output plain "
               "while a residual argument is a DTensor (BLOOM dropout_add, ELECTRA/BERT SelfOutput, user MLP)",
         fix="make each TP block one DTensor region: replicate every non-split parameter and buffer "
             "(distribute_module) and keep row-parallel outputs DTensor until the region's exit"),
    dict(id="sp-sequence-shard-attention",
         title="TP+SP puts a block on sequence shards although no region gathers the sequence for attention",
         match=lambda c, g: c["status"] == "mismatch" and c["layout"] == "tp_sp",
         where="tensor_parallel.py:214-223 shards every block's input on dim 1 under SP; nn.TransformerEncoderLayer's "
               "attention is nn.MultiheadAttention (in_proj is a bare Parameter: the probe finds no column-"
               "parallel Linear, tensor_parallel.py:186), so no ReplicateModuleInputs gathers the sequence and "
               "each rank attends over its half (silent)",
         fix="sequence-shard a block only when every sequence-mixing child is a recognised region that "
             "gathers; otherwise refuse SP for it (or split nn.MultiheadAttention's in_proj by heads)"),
    dict(id="sp-uneven-sequence",
         title="TP+SP with a sequence tp does not divide aborts gloo",
         match=lambda c, g: c["status"] in ("abort", "crash", "hang") and c["layout"] == "tp_sp"
         and c["arch"] == "llama_seq15",
         where="no check of seq % tp in manual_plan.py / the planner / tensor_parallel.py:214-223: Shard(1) of 15 "
               "tokens gives shards of 8 and 7, a collective posts different sizes (8192 vs 7168 bytes)",
         fix="refuse before running when tp does not divide the sequence (or pad it)"),
    dict(id="user-loss-mean-of-means",
         title="a user loss that ignores -100 targets averages per-shard means (dp / micro-batches)",
         match=lambda c, g: c["status"] == "mismatch" and c["arch"] == "bert_ce_ignore",
         where="parallel_model.py:124-136 `_accumulate` averages micro-batch losses (loss / n) and dp averages "
               "ranks: with -100 labels the shards score different token counts, so the step's loss is a "
               "mean of means, not the global mean one process computes (autopar corrects this only for "
               "transformers' own loss, HFCausalLMLoss)",
         fix="probe the user's loss for ignored targets (as loss_parallel is probed) and weigh each "
             "micro-batch by its scored-target count, or document that loss_fn must be token-weighted"),
]


def cause_of(cell: dict, grid: dict) -> str | None:
    if cell["status"] == "pass":
        return None
    for cause in CAUSES:
        try:
            if cause["match"](cell, grid):
                return cause["id"]
        except Exception:
            continue
    return "unclassified"


def write_report(data: dict, out_dir: str, name: str) -> tuple[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    cells = data["cells"]
    archs = [a for a in data["arch_order"] if any(c["arch"] == a for c in cells)]
    layouts = [l for l in LAYOUTS if any(c["layout"] == l for c in cells)]
    grid = {(c["arch"], c["layout"]): c for c in cells}
    lines = [f"# Lowering matrix (issue 12): architectures x layouts vs one process", "",
             f"Command: `{data['command']}`  ", f"Date: {data['date']}  ",
             *[f"Re-run: `{r['command']}` ({r['date']}, {r['cells']} cells replaced)  " for r in data.get("reruns", [])],
             f"Total wall time: {data['wall_s'] / 60:.1f} min on {data['host']}"
             + (" (first run plus re-runs)" if data.get("reruns") else "") + "  ",
             f"Code: autopar at commit `{data['git']['commit'][:12]}`"
             + (" (a `git archive` snapshot of that commit, not the working tree)" if data["git"].get("snapshot_of_head") else
                " (autopar/ had uncommitted changes)" if data["git"].get("dirty_autopar") else "")
             + f", {', '.join(f'{k} {v}' for k, v in data['versions'].items())}  ",
             f"Not in this transformers: {', '.join(data['missing']) or 'none'}", "",
             "Each cell: tiny random model (hidden 64, 4 blocks, fp32, dropout 0), 3 SGD steps (lr 0.5, momentum "
             "0.9) on 3 global batches of 8, loss at every step and every parameter vs one process training the "
             f"same model (the model's own loss where it computes one from `labels`). Tolerance {TOL:g} relative "
             f"(parameters: max|p - ref| / max(max|ref|, {PARAM_FLOOR:g}), held to max({TOL:g}, 2 x the "
             f"architecture's own sensitivity: one process against itself with every weight nudged by "
             f"{PERTURB:g} relative; the architectures where that exceeds {TOL:g}: "
             + (", ".join(sorted({f"{c['arch']} ({c['param_tol']:.2g})" for c in cells
                                  if c.get("param_tol", TOL) > TOL})) or "none") + ").", "",
             "Legend: `ok` pass · `R` refused before running, same reason on every rank · `**M**` mismatch · "
             "`**C**` crash (exception) · `**A**` abort (a rank died) · `**H**` hang (timeout) · `-` not run · "
             "`ok*` passed under tp > 1, but no block parameter was sharded over tp (the blocks ran replicated)", "",
             "Layouts (world size): " + "; ".join(
                 f"`{l}` ({LAYOUTS[l][0]}: {', '.join(f'{k}={v}' for k, v in (LAYOUTS[l][1] or {'autopar.plan': 'cpu x4, fp32', **PLANNER_PINS[l]}).items())})"
                 for l in layouts), "",
             "| arch | family | " + " | ".join(layouts) + " |", "|---|---|" + "---|" * len(layouts)]
    def code(c):
        if c["status"] == "pass" and c.get("tp_sharded_blocks", c.get("tp_sharded")) == 0 \
                and " tp1 " not in f" {c.get('layout_run', '')} ":
            return "ok*"
        return CODES[c["status"]]
    for a in archs:
        row = [code(grid[(a, l)]) if (a, l) in grid else "-" for l in layouts]
        lines.append(f"| {a} | {data['family'].get(a, '')} | " + " | ".join(row) + " |")
    # counts
    lines += ["", "## Counts", "", "| layout | " + " | ".join(STATUSES) + " |", "|---|" + "---|" * len(STATUSES)]
    for l in layouts + ["all"]:
        sel = [c for c in cells if l == "all" or c["layout"] == l]
        lines.append(f"| {l} | " + " | ".join(str(sum(c['status'] == s for c in sel)) for s in STATUSES) + " |")
    beyond = [c for c in cells if data["family"].get(c["arch"]) not in ("control", "explicit-loss twin")]
    tppp = [c for c in beyond if c["layout"] in TP_PP]
    refused = sum(c["status"] == "refused" for c in tppp)
    n = {st: sum(c["status"] == st for c in beyond) for st in STATUSES}
    lines += ["", f"Acceptance view (the {len({c['arch'] for c in beyond})} architectures beyond the controls and "
              f"the explicit-loss twins, {len(beyond)} cells): {n['pass']} pass, {n['refused']} refused, "
              f"{n['mismatch']} silent mismatches, {n['crash']} crashes, {n['abort']} aborts, {n['hang']} hangs "
              f"(wanted: 0 / 0 / 0 / 0). TP/PP cells refused: {refused}/{len(tppp)} "
              f"({100 * refused / max(len(tppp), 1):.0f}%; wanted <= 20%)."]
    for planner_layout, pins in PLANNER_PINS.items():
        planner = [c for c in cells if c["layout"] == planner_layout and c.get("layout_run")]
        if planner:
            pinned = f" (pinned {', '.join(f'{k}={v}' for k, v in pins.items())})" if pins else ""
            lines += ["", f"Planner's choices{pinned}: " + "; ".join(f"{c['arch']}: {c['layout_run']}"
                                                                  for c in planner) + "."]
    by_cause: dict[str, list] = {}
    for c in cells:
        cid = cause_of(c, grid)
        c["cause"] = cid
        if cid:
            by_cause.setdefault(cid, []).append(c)
    lines += ["", "## Root causes", "",
              "Each failing cell is matched to the first cause whose symptom it shows (`CAUSES` in run.py; "
              "code locations as read at a82ebdf, the baseline).", ""]
    for i, cause in enumerate(CAUSES + [dict(id="unclassified", title="not matched by any cause", where="-",
                                             fix="-")], 1):
        got = by_cause.get(cause["id"], [])
        if not got:
            continue
        tally = ", ".join(f"{n} {s}" for s, n in sorted(
            {s: sum(c["status"] == s for c in got) for s in STATUSES}.items()) if n)
        order = {l: i for i, l in enumerate(LAYOUTS)}
        got.sort(key=lambda c: order.get(c["layout"], 99))
        cells_txt = "; ".join(f"{a}: {', '.join(c['layout'] for c in got if c['arch'] == a)}"
                              for a in archs if any(c["arch"] == a for c in got))
        lines += [f"{i}. **{cause['title']}** (`{cause['id']}`, {len(got)} cells: {tally})  ",
                  f"   cells: {cells_txt}  ", f"   where: {cause['where']}  ", f"   fix: {cause['fix']}", ""]
    lines += ["## Findings (every cell that is not `ok`)", ""]
    for a in archs:
        for l in layouts:
            c = grid.get((a, l))
            if c and c["status"] != "pass":
                lines.append(f"- `{a}` / `{l}`: **{c['status']}** [{c.get('cause')}] — {_cell_text(c)}")
    md = os.path.join(out_dir, f"{name}.md")
    js = os.path.join(out_dir, f"{name}.json")
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(js, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return md, js


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--plan-only"]:  # the planner's own process (see _planner_plan)
        arch_name, world, pins = json.loads(argv[1])
        print(json.dumps(plan_only(arch_name, world, pins)))
        return 0
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # `--arch` is no `--archs-file`
    pre.add_argument("--archs-file")
    outside = pre.parse_known_args(argv)[0].archs_file
    if outside:  # before archs is imported, here and (through the environment) on every rank
        os.environ["AUTOPAR_MATRIX_ARCHS"] = os.path.abspath(outside)
    from archs import ARCHS, FAMILY, MISSING, ORDER

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs-file", help="a Python file defining ARCHS {name: () -> archs.Arch} (and FAMILY): "
                                         "architectures kept outside this repository, run beside the matrix's")
    ap.add_argument("--arch", help="comma-separated architectures (default: all): " + ",".join(ARCHS))
    ap.add_argument("--layout", help="comma-separated layouts (default: all): " + ",".join(LAYOUTS))
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument("--name", default=None, help="output file stem (default lowering_matrix, or "
                                                 "lowering_matrix_partial for a filtered run)")
    ap.add_argument("--merge", action="store_true", help="replace the cells run in an existing <name>.json")
    ap.add_argument("--cell-timeout", type=float, default=180.0, help="seconds per cell before it counts as a hang")
    ap.add_argument("--snapshot", action="store_true",
                    help="run against `git archive REV` of this repository (autopar/, cost_models/) extracted to a "
                         "temporary directory, so edits to the working tree during a long run do not leak in")
    ap.add_argument("--rev", default="HEAD", help="the commit --snapshot extracts (default HEAD)")
    ap.add_argument("--logs", default=os.path.join("/tmp", "lowering_matrix_logs"), help="per-rank logs")
    ap.add_argument("--report-only", action="store_true", help="rewrite <name>.md from <name>.json, run nothing")
    args = ap.parse_args(argv)
    if args.report_only:
        stem = args.name or "lowering_matrix"
        with open(os.path.join(args.out, f"{stem}.json")) as f:
            md, _ = write_report(json.load(f), args.out, stem)
        print(f"wrote {md}")
        return

    archs = args.arch.split(",") if args.arch else list(ARCHS)
    layouts = args.layout.split(",") if args.layout else list(LAYOUTS)
    for a in archs:
        if a not in ARCHS:
            sys.exit(f"unknown arch {a!r} (missing in this transformers: {MISSING})" if a in MISSING
                     else f"unknown arch {a!r}; one of {', '.join(ARCHS)}")
    for l in layouts:
        if l not in LAYOUTS:
            sys.exit(f"unknown layout {l!r}; one of {', '.join(LAYOUTS)}")
    name = args.name or ("lowering_matrix" if not (args.arch or args.layout) or args.merge
                         else "lowering_matrix_partial")
    os.makedirs(args.logs, exist_ok=True)
    snapshot = _snapshot(args.rev) if args.snapshot else None
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    import torch
    torch.set_num_threads(1)

    command = "python3 benchmarks/lowering_matrix/run.py" + "".join(
        f" {a}" for a in sys.argv[1:]) if argv is None else "run.py " + " ".join(argv)
    t0 = time.time()
    cells = []
    prev = None
    if args.merge and os.path.exists(os.path.join(args.out, f"{name}.json")):
        with open(os.path.join(args.out, f"{name}.json")) as f:
            prev = json.load(f)
        run = {(a, l) for a in archs for l in layouts}
        cells = [c for c in prev["cells"] if (c["arch"], c["layout"]) not in run]

    def progress(arch, layout, world, rec):
        extra = _cell_text(rec)
        print(f"[{time.time() - t0:7.0f}s] {arch:18s} {layout:15s} w{world} {rec['status']:8s} "
              f"{rec.get('seconds', 0):5.1f}s {extra[:220]}", flush=True)

    data = {"command": command, "date": _dt.datetime.now().isoformat(timespec="seconds"),
            "host": f"{os.cpu_count()} CPU cores", "git": _git_state(), "versions": _versions(),
            "missing": MISSING, "arch_order": ORDER, "family": FAMILY, "layouts": {k: v for k, v in LAYOUTS.items()},
            "settings": {"global_batch": GLOBAL_BATCH, "steps": STEPS, "lr": LR, "momentum": MOMENTUM, "tol": TOL,
                         "param_floor": PARAM_FLOOR, "cell_timeout_s": args.cell_timeout}, "cells": cells}
    if prev:  # the matrix keeps its first command and date; re-runs of some cells are listed
        data["command"], data["date"] = prev["command"], prev["date"]
        data["reruns"] = prev.get("reruns", []) + [{"command": command, "date": _dt.datetime.now().isoformat(
            timespec="seconds"), "cells": len([1 for a in archs for l in layouts])}]
    try:
        for a in archs:
            try:
                res = run_arch(a, layouts, args.cell_timeout, args.logs, progress)
            except Exception as exc:  # the reference itself failed: every cell of the arch is a crash
                res = {l: {"status": "crash", "message": f"harness/reference: {_first_line(exc)}",
                           "where": _where(exc), "world": LAYOUTS[l][0]} for l in layouts}
                print(traceback.format_exc(), flush=True)
            for l in layouts:
                rec = dict(res.get(l) or {"status": "crash", "message": "harness: the world returned no record"})
                cells.append({"arch": a, "layout": l, **rec})
            data["wall_s"] = time.time() - t0 + (prev["wall_s"] if prev and args.merge else 0)
            write_report(data, args.out, name)  # after every arch: a partial matrix survives an interruption
    finally:
        _kill_all()
        if snapshot:
            import shutil
            shutil.rmtree(snapshot, ignore_errors=True)
    md, js = write_report(data, args.out, name)
    print(f"wrote {md} and {js} in {(time.time() - t0) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
