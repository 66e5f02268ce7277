"""autopar's compiled training step against hand-written torch.distributed scripts of
the same layout and model (issue 14, item 9: overhead at most 3%).

    python3 benchmarks/train_overhead.py              # 2 gloo ranks on this machine's CPU
    python3 benchmarks/train_overhead.py --quick      # fewer steps (a smoke test)

The model is the Llama of examples/llama.py at a size whose steps take a tenth of
a second on a CPU core (dim 256, 4 layers, 8 heads / 4 kv heads, vocab 2048,
sequence 128, 4 sequences per rank). Each layout is written twice:

  hand     what a user writes with torch.distributed directly, torchtitan style:
           FSDP2 fully_shard on the embedding, each block, [norm, output] and
           the root; DDP; TP with ColwiseParallel /
           RowwiseParallel on q, k, v, o and the MLP and the heads per rank
           divided by tp (embedding and head replicated)
  autopar  ParallelModel.train_step on a hand plan of the same layout (the
           embedding and head replicated too), as the emitted train.py runs it

Both take the same step: zero_grad, forward, cross-entropy, backward, clip by
the global norm (1.0), AdamW, and the loss averaged over ranks for the log.
They run in the same processes, alternating blocks of steps so that the
machine's drift (a shared VM) falls on both alike; the step time is rank 0's,
median over every timed step. Writes benchmarks/results/train_overhead.{json,md}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

WORLD, PER_RANK, SEQ = 2, 4, 128
LAYOUTS = ("fsdp_dp2", "ddp_dp2", "tp2")


def _config():
    import llama
    return dataclasses.replace(llama.PRESETS["llama_tiny"], vocab_size=2048, seq_len=SEQ, dim=256, layers=4,
                               heads=8, kv_heads=4, ffn_hidden=688)


def _model():
    import llama
    torch.manual_seed(0)
    return llama.Llama(_config())


def _hand(layout: str, mesh, compiled: bool = False):
    """(step function) for the hand-written script of this layout; `compiled`: each
    block torch.compile'd in place before FSDP2 / DDP, as torchtitan's apply_compile
    does (benchmarks/compile_overhead.py)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = _model()
    if compiled and layout != "tp2":
        for block in model.layers:
            block.compile(fullgraph=True)
    if layout == "fsdp_dp2":  # torchtitan's units: embedding, each block, [norm, output], root
        fully_shard(model.tok_embeddings, mesh=mesh)
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard([model.norm, model.output], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "ddp_dp2":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        for block in model.layers:
            parallelize_module(block, mesh, {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                                             "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                                             "feed_forward.w1": ColwiseParallel(),
                                             "feed_forward.w3": ColwiseParallel(),
                                             "feed_forward.w2": RowwiseParallel()})
            block.attention.heads //= WORLD  # this rank's heads, as torchtitan adjusts them
            block.attention.kv_heads //= WORLD
    # torch's foreach kernels take no list mixing DTensor (split linears) and plain tensors (norms)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False if layout == "tp2" else None)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        if layout == "tp2":  # clip_grad_norm_ refuses a list mixing DTensor and plain gradients
            _clip_mixed(list(model.parameters()), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged)
        return logged.item() / WORLD
    return step


def _clip_mixed(params, max_norm: float) -> None:
    """The global norm of split (DTensor) and replicated (plain) gradients, then clip."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm
    grads = [p.grad for p in params if p.grad is not None]
    split = [g for g in grads if isinstance(g, DTensor)]
    whole = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.stack([get_total_norm(split, foreach=False).full_tensor(),
                         get_total_norm(whole, foreach=False)]).norm()
    clip_grads_with_norm_(params, max_norm, total, foreach=False)


def _autopar(layout: str, torch_compile=False):
    import llama
    from autopar.lower import compile, plan_for_model
    model = _model()
    example = lambda b: llama.example_inputs(b, _config())  # noqa: E731
    kw = {"fsdp_dp2": dict(dp=2, zero=3, micro_batch_size=PER_RANK),
          "ddp_dp2": dict(dp=2, zero=0, micro_batch_size=PER_RANK),
          "tp2": dict(tp=2, micro_batch_size=PER_RANK)}[layout]
    plan = plan_for_model(model, example_inputs=example, **kw)
    for c in plan.layer_choices:  # the hand script keeps the embedding and head whole
        if c.tp_style == "vocab":
            c.tp_style = "replicate"
    pm = compile(model, example_inputs=example, loss_fn=llama.loss_fn, plan=plan, optimizer=torch.optim.AdamW,
                 optimizer_kwargs={"lr": 1e-4}, local_batch=True, torch_compile=torch_compile)
    pm.max_grad_norm = 1.0
    return lambda x, y: pm.train_step((x,), y)


def layout_data(layout: str, rank: int) -> list:
    """This rank's 4 batches of (PER_RANK or, under tp, the whole) sequences of SEQ + 1 tokens."""
    dp = layout != "tp2"
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 2048, (PER_RANK * (WORLD if dp else 1), SEQ + 1), generator=g) for _ in range(4)]
    return [d[rank * PER_RANK:(rank + 1) * PER_RANK] if dp else d for d in data]


def time_steppers(steppers: dict, mine: list, steps: int, blocks: int, warmup: int = 2) -> dict:
    """{name: [seconds per step]}: `warmup` untimed steps each (buffers, caches, compilation),
    then `blocks` blocks of `steps` steps, alternating the order so drift falls on all alike."""
    times = {k: [] for k in steppers}
    for name, fn in steppers.items():
        for i in range(warmup):
            d = mine[i % len(mine)]
            fn(d[:, :-1], d[:, 1:])
    for b in range(blocks):
        order = list(steppers) if b % 2 == 0 else list(steppers)[::-1]
        for name in order:
            for i in range(steps):
                d = mine[i % len(mine)]
                dist.barrier()
                t0 = time.perf_counter()
                steppers[name](d[:, :-1], d[:, 1:])
                times[name].append(time.perf_counter() - t0)
    return times


def _world(rank: int, port: int, steps: int, blocks: int, out):
    try:
        _run_world(rank, port, steps, blocks, out)
    except BaseException:  # the parent waits on the queue: give it the error, not a silence
        import traceback
        out.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise


def _run_world(rank: int, port: int, steps: int, blocks: int, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for layout in LAYOUTS:
        mine = layout_data(layout, rank)
        steppers = {"hand": _hand(layout, mesh), "autopar": _autopar(layout)}
        times = time_steppers(steppers, mine, steps, blocks)
        from torch.distributed.tensor.debug import CommDebugMode
        comms = {}
        for name, fn in steppers.items():  # one more step, its collectives counted (not timed)
            with CommDebugMode() as cm:
                fn(mine[0][:, :-1], mine[0][:, 1:])
            comms[name] = sum(cm.get_comm_counts().values())
        results[layout] = {"times": times, "collectives": comms}
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def spawn_world(target, steps: int, blocks: int) -> dict:
    """Run target(rank, port, steps, blocks, queue) on WORLD spawned ranks; rank 0's results
    (a rank's {"error": traceback} ends every rank)."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, steps, blocks, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = q.get(timeout=3600)
    if "error" in results:
        for p in procs:
            p.kill()
        raise SystemExit(results["error"])
    for p in procs:
        p.join()
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_overhead"))
    args = ap.parse_args(argv)
    steps, blocks = (3, 2) if args.quick else (10, 12)
    results = spawn_world(_world, steps, blocks)
    rows = []
    for layout, r in results.items():
        times = r["times"]
        hand, ours = statistics.median(times["hand"]), statistics.median(times["autopar"])
        rows.append({"layout": layout, "hand_s": hand, "autopar_s": ours, "overhead": ours / hand - 1,
                     "steps_each": len(times["hand"]), "hand_collectives": r["collectives"]["hand"],
                     "autopar_collectives": r["collectives"]["autopar"]})
    meta = {"command": "python3 benchmarks/train_overhead.py" + (" --quick" if args.quick else ""),
            "machine": f"{os.cpu_count()} CPU cores, {WORLD} gloo ranks x 1 thread, torch {torch.__version__}",
            "model": dataclasses.asdict(_config()), "per_rank_batch": PER_RANK, "target": "overhead <= 3%"}
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# Compiled training step vs hand-written torch.distributed (CPU, gloo)", "",
             f"`{meta['command']}` on {meta['machine']}; Llama {_config().dim} x {_config().layers} layers, "
             f"sequence {SEQ}, {PER_RANK} sequences per rank; median of {rows[0]['steps_each']} timed steps each, "
             "alternating blocks. Target: overhead <= 3%.", "",
             "| layout | hand-written s/step | autopar s/step | overhead | collectives per step, hand / autopar |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['hand_s']:.4f} | {r['autopar_s']:.4f} | {r['overhead']:+.1%} | "
              f"{r['hand_collectives']} / {r['autopar_collectives']} |" for r in rows]
    tp = next(r for r in rows if r["layout"] == "tp2")
    if tp["overhead"] > 0.03:
        lines += ["", f"tp2 misses the target ({tp['overhead']:+.0%}). The hand script divides the attention "
                  "module's head counts by tp and runs attention on plain local tensors; autopar takes the model "
                  "as written and keeps the activations inside attention and the MLP as DTensors with global "
                  "shapes (autopar/lower/tensor_parallel.py). The time goes to the communication DTensor "
                  f"inserts, not to its dispatch: {tp['autopar_collectives']} collectives a step against "
                  f"{tp['hand_collectives']} (CommDebugMode): each attention's backward adds 2 all-gathers and "
                  "a reduce-scatter (attributed to the output projection's backward; repeat_kv, RoPE and SDPA "
                  "forward run without communication when checked alone), and each block one more all-reduce, "
                  "each a gloo round trip of about a millisecond here. A DTensor elementwise op measured 24 us "
                  "against 16 us on a plain tensor. Not yet measured on a GPU."]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
