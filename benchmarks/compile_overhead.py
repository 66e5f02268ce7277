"""autopar's compiled program against autopar eager and hand-written compiled scripts
(issue 31, item 4: overhead at most 3% against the hand-written compiled script).

    python3 benchmarks/compile_overhead.py                 # 2 gloo ranks on this machine's CPU
    python3 benchmarks/compile_overhead.py --quick         # fewer steps (a smoke test)
    python3 benchmarks/compile_overhead.py --device cuda   # one GPU (benchmarks/gpu_run.sh runs it)

CPU: the model, data, step and alternating timing of benchmarks/train_overhead.py
(Llama dim 256, 4 layers, sequence 128, 4 sequences per rank, AdamW, clipping at 1.0),
layouts FSDP2 (ZeRO-3) and DDP over 2 ranks, each run four ways:

  hand_eager        the hand-written torchtitan-style script of train_overhead.py
  hand_compiled     the hand-written torchtitan-style script, each block
                    `block.compile(fullgraph=True)` before fully_shard / DDP
                    (torchtitan's apply_compile)
  autopar_compiled  autopar.compile(..., torch_compile=True) on a hand plan of the layout
  autopar_eager     the same with torch_compile=False

CUDA (one GPU, bf16 autocast, a 1.1B Llama by default: `--dim/--layers/--seq/--batch`):
hand-written eager, hand-written `torch.compile(model)` (the one line the issue
measured), autopar eager and autopar compiled on a one-GPU plan, one after the
other (four copies of a 1B model's training state would not fit at once).

Each variant's first step (where compilation happens) is timed alone; then the
median over the timed steps after warm-up. Writes
benchmarks/results/compile_overhead{_cuda}.{json,md}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import train_overhead as base  # noqa: E402

CPU_LAYOUTS = ("fsdp_dp2", "ddp_dp2")


def _first_steps(steppers: dict, mine: list, sync=lambda: None) -> dict:
    """{name: seconds of the first step} (tracing and inductor's compilation happen here)."""
    first = {}
    for name, fn in steppers.items():
        d = mine[0]
        sync()
        t0 = time.perf_counter()
        fn(d[:, :-1], d[:, 1:])
        sync()
        first[name] = time.perf_counter() - t0
    return first


def _cpu_world(rank: int, port: int, steps: int, blocks: int, out):
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(base.WORLD), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (base.WORLD,))
        results = {}
        for layout in CPU_LAYOUTS:
            mine = base.layout_data(layout, rank)
            steppers = {"hand_eager": base._hand(layout, mesh),
                        "hand_compiled": base._hand(layout, mesh, compiled=True),
                        "autopar_compiled": base._autopar(layout, torch_compile=True),
                        "autopar_eager": base._autopar(layout, torch_compile=False)}
            first = _first_steps(steppers, mine)
            times = base.time_steppers(steppers, mine, steps, blocks, warmup=1)
            results[layout] = {"times": times, "first_step_s": first}
        if rank == 0:
            out.put(results)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # the parent waits on the queue: give it the error, not a silence
        import traceback
        out.put({"error": f"rank {rank}: {traceback.format_exc()}"})
        raise


def _gpu_config(args):
    import llama
    return dataclasses.replace(llama.PRESETS["llama_tiny"], vocab_size=32000, seq_len=args.seq, dim=args.dim,
                               layers=args.layers, heads=args.dim // 64, kv_heads=max(1, args.dim // 256),
                               ffn_hidden=args.ffn or int(args.dim * 8 / 3 // 256 * 256))


def _gpu_stepper(cfg, batch: int, variant: str):
    """One GPU, bf16: hand eager (autocast), hand torch.compile(model), autopar eager / compiled."""
    import llama

    from autopar.lower import compile, plan_for_model
    torch.manual_seed(0)
    m = llama.Llama(cfg).cuda()
    if variant.startswith("hand"):
        run = torch.compile(m) if variant == "hand_compiled" else m
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            return loss.item()
        return step
    example = lambda b: llama.example_inputs(b, cfg)  # noqa: E731
    plan = plan_for_model(m, example_inputs=example, micro_batch_size=batch, precision="bf16")
    pm = compile(m, example_inputs=example, loss_fn=llama.loss_fn, plan=plan, optimizer=torch.optim.AdamW,
                 optimizer_kwargs={"lr": 1e-4, "fused": True}, torch_compile=variant == "autopar_compiled")
    pm.max_grad_norm = 1.0
    return lambda x, y: pm.train_step((x,), y)


GPU_VARIANTS = ("hand_eager", "hand_compiled", "autopar_eager", "autopar_compiled")


def run_cuda(args, done=lambda results: None) -> dict:
    """One variant at a time (a 1B model's weights, AdamW state and activations four times
    over would not fit), each: first step timed alone, warm-up, then the timed steps;
    `done(results so far)` after each (a run cut short keeps what it measured)."""
    import gc
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    dist.init_process_group("nccl")
    cfg = _gpu_config(args)
    torch.manual_seed(1)
    mine = [torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), device="cuda") for _ in range(2)]
    times, first = {}, {}
    results = {"single_gpu": {"times": times, "first_step_s": first, "model": dataclasses.asdict(cfg),
                              "device": torch.cuda.get_device_name()}}
    for variant in GPU_VARIANTS:
        steppers = {variant: _gpu_stepper(cfg, args.batch, variant)}
        first.update(_first_steps(steppers, mine, torch.cuda.synchronize))
        times.update(base.time_steppers(steppers, mine, args.steps * args.blocks, 1, warmup=2))
        del steppers
        gc.collect()
        torch.cuda.empty_cache()
        done(results)
    dist.destroy_process_group()
    return results


def _paired(times: dict, a: str, b: str, steps: int) -> float | None:
    """Median over blocks of (a's median / b's median in that block): the variants of a
    block ran minutes apart at most, so the machine's drift cancels in each ratio."""
    if a not in times or b not in times or len(times[a]) != len(times[b]):
        return None
    n = len(times[a]) // steps
    return statistics.median(statistics.median(times[a][k * steps:(k + 1) * steps]) /
                             statistics.median(times[b][k * steps:(k + 1) * steps]) for k in range(n))


def _rows(results: dict, baseline: str, steps: int) -> list[dict]:
    rows = []
    for layout, r in results.items():
        med = {k: statistics.median(v) for k, v in r["times"].items()}

        def ratio(a, b):  # paired by block on CPU; None until both are measured (a GPU run cut short)
            if steps:
                return _paired(r["times"], a, b, steps)
            return med[a] / med[b] if a in med and b in med else None
        rows.append({"layout": layout, "median_s": med, "first_step_s": r["first_step_s"],
                     "steps_each": len(next(iter(r["times"].values()))),
                     "compiled_vs_" + baseline: ratio("autopar_compiled", baseline),
                     "compiled_vs_eager": ratio("autopar_compiled", "autopar_eager"),
                     "hand_compiled_vs_hand_eager": ratio("hand_compiled", "hand_eager")})
    return rows


def _write(out: str, meta: dict, rows: list[dict], baseline: str, notes: list[str]) -> None:
    Path(out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    variants = list(rows[0]["median_s"])
    lines = ["# autopar compiled vs autopar eager vs hand-written compiled", "", f"`{meta['command']}` on "
             f"{meta['machine']}; {meta['model']}; median of {rows[0]['steps_each']} timed steps each after "
             f"warm-up; ratios: {meta['ratios']}; first step (compilation) timed alone. Target: autopar "
             f"compiled / {baseline} <= 1.03.", "",
             "| layout | " + " | ".join(f"{v} s/step" for v in variants) +
             f" | autopar compiled / {baseline} | autopar compiled / autopar eager | hand compiled / hand eager "
             "| first step s, " + " / ".join(variants) + " |",
             "|---|" + "---|" * (len(variants) + 4)]
    def show(x):
        return "-" if x is None else f"{x:.3f}"
    for r in rows:
        lines.append(f"| {r['layout']} | " + " | ".join(f"{r['median_s'][v]:.4f}" for v in variants) +
                     f" | {show(r['compiled_vs_' + baseline])} | {show(r['compiled_vs_eager'])} | "
                     f"{show(r['hand_compiled_vs_hand_eager'])} | " +
                     " / ".join(f"{r['first_step_s'][v]:.1f}" for v in variants) + " |")
    Path(out + ".md").write_text("\n".join(lines + [""] + notes) + "\n")
    print("\n".join(lines + [""] + notes))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per block")
    ap.add_argument("--blocks", type=int, default=None, help="alternating blocks")
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--note", action="append", default=[], help="a line for the results file (e.g. the load)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.steps = args.steps or (3 if args.quick else 5 if cuda else 3)
    args.blocks = args.blocks or (2 if args.quick else 4 if cuda else 16)
    out = args.out or str(ROOT / "benchmarks" / "results" / ("compile_overhead_cuda" if cuda else "compile_overhead"))
    given = list(argv if argv is not None else sys.argv[1:])
    for note in args.note:  # the notes are printed below the table, not in the command
        i = given.index(note)
        del given[i - 1:i + 1]
    command = "python3 benchmarks/compile_overhead.py " + " ".join(given) + (' --note "..."' if args.note else "")
    if cuda:
        def done(results):
            cfg = results["single_gpu"]["model"]
            meta = {"command": command.strip(), "machine": f"1 x {results['single_gpu']['device']}, torch "
                    f"{torch.__version__}", "model": f"Llama dim {cfg['dim']} x {cfg['layers']} layers, "
                    f"sequence {cfg['seq_len']}, batch {args.batch}, bf16",
                    "ratios": "of the medians (one variant after the other)"}
            _write(out, meta, _rows(results, "hand_compiled", 0), "hand_compiled", args.note)
        run_cuda(args, done)
        return 0
    results = base.spawn_world(_cpu_world, args.steps, args.blocks)
    c = base._config()
    meta = {"command": command.strip(), "machine": f"{os.cpu_count()} CPU cores, {base.WORLD} gloo ranks x 1 "
            f"thread, torch {torch.__version__}", "model": f"Llama dim {c.dim} x {c.layers} layers, sequence "
            f"{base.SEQ}, {base.PER_RANK} sequences per rank, fp32, alternating blocks of {args.steps} steps",
            "ratios": "median over blocks of the ratio of the two variants' medians in that block (paired: the "
                      "machine's drift cancels)"}
    _write(out, meta, _rows(results, "hand_compiled", args.steps), "hand_compiled", args.note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
