"""Float8 plans on one GPU (issue 31, item 3): priced, lowered, trained 50 steps.

    python3 benchmarks/float8_gpu.py plan  [--device h100-sxm]    # here: each case priced compiled, bf16 and float8
    python3 benchmarks/float8_gpu.py measure --out M.json          # on the GPU (torchao carried as a wheel)
    python3 benchmarks/float8_gpu.py table M.json                  # here: speedups and losses, written to results

Each case (benchmarks/gpu_step_time.py's models, the layout pinned: one GPU, bf16,
its micro-batch and checkpointing) is planned twice with compiled blocks: as
`autopar plan --compile` (bf16 GEMMs) and as `autopar plan --compile --float8`
(the cost model picks the layers whose Linears run float8). On the GPU both plans
run through autopar.compile with torch_compile=True for STEPS steps on the same
batches (FIXED_BATCHES cycled, so the loss falls far enough to compare), recording
every step's loss and time. `table` writes, per case: the predicted and measured
speedup of float8 over bf16 (median step after WARMUP), and the largest relative
gap between the two loss curves over the last 10 steps, against LOSS_TOLERANCE
(set before any measurement: float8 training is expected to track bf16 within
noise, torchtitan's float8 loss curves).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

import gpu_step_time as g  # noqa: E402

CASES = ("llama_1b", "gpt_1.3b_s2048", "llama_3b_ckpt")
STEPS, WARMUP, FIXED_BATCHES = 50, 10, 4
LOSS_TOLERANCE = 0.03  # relative, each of the last 10 steps
RESULTS = ROOT / "benchmarks" / "results"


def plans_file(device: str) -> Path:
    return RESULTS / f"float8_plans_{device}.json"


def predict(name: str, cluster, float8: bool) -> dict:
    import autopar
    from autopar.engine import COMPILED, COMPILED_FLOAT8
    from autopar.lower.api import captured_with_loss

    model, inputs, loss_fn, _ = g.build(name)
    batch, ckpt = g.CASES[name][3], g.CASES[name][4]
    constraints = dict(dp=1, tp=1, pp=1, zero=0, micro_batch=batch, checkpoint=ckpt)
    plan = autopar.plan(captured_with_loss(model, inputs, loss_fn), cluster, global_batch_size=batch,
                        constraints=constraints, precision="bf16", fusion=False, module=model,
                        engine=COMPILED_FLOAT8 if float8 else COMPILED)
    return plan.to_dict()


def cmd_plan(args) -> int:
    out = {}
    for name in args.cases.split(",") if args.cases else CASES:
        print(f"planning {name} ...", file=sys.stderr)
        out[name] = {"bf16": predict(name, g.one_gpu(args.device), False),
                     "float8": predict(name, g.one_gpu(args.device), True)}
        p0, p1 = (out[name][k]["predicted"]["step_time_s"] for k in ("bf16", "float8"))
        layers = out[name]["float8"]["assumptions"]["float8"]
        print(f"  bf16 {p0 * 1e3:.1f} ms, float8 {p1 * 1e3:.1f} ms ({p0 / p1:.2f}x), {layers['layers']} layers, "
              f"{layers['linears']} Linears in float8", file=sys.stderr)
    plans_file(args.device).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {plans_file(args.device)}", file=sys.stderr)
    return 0


def _train(name: str, plan: dict) -> dict:
    import autopar

    model, inputs, loss_fn, cfg = g.build(name, device="cuda")
    t0 = time.perf_counter()
    pm = autopar.compile(model, example_inputs=inputs, loss_fn=loss_fn, plan=plan, torch_compile=True)
    batch = g.CASES[name][3]
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = [(torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen, device="cuda"),
             torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen, device="cuda"))
            for _ in range(FIXED_BATCHES)]
    losses, times = [], []
    for step in range(STEPS):
        x, y = data[step % FIXED_BATCHES]
        torch.cuda.synchronize()
        t = time.perf_counter()
        losses.append(pm.train_step((x,), y))  # a float: the step has finished
        times.append(time.perf_counter() - t)
    converted = sum(type(m).__name__.endswith("Float8Linear") for m in model.modules())
    out = {"losses": losses, "times_s": times, "median_s": statistics.median(times[WARMUP:]),
           "peak_allocated_bytes": torch.cuda.max_memory_allocated(), "float8_linears": converted,
           "wall_s": time.perf_counter() - t0, "notes": list(pm.notes)}
    del pm, model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return out


def cmd_measure(args) -> int:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29543"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    plans = json.loads(plans_file(args.device).read_text())
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
               "steps": STEPS, "warmup": WARMUP, "cases": {}}
    for name in args.cases.split(",") if args.cases else plans:
        for kind in ("bf16", "float8"):
            try:
                r = _train(name, plans[name][kind])
                print(f"{name:16s} {kind:6s} step {r['median_s'] * 1e3:8.1f} ms  loss {r['losses'][0]:.3f} -> "
                      f"{r['losses'][-1]:.3f}  float8 Linears {r['float8_linears']}", flush=True)
            except Exception as exc:  # noqa: BLE001 - one case failing keeps the others
                r = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
                print(f"{name} {kind}: {r['error']}", flush=True)
                torch.cuda.empty_cache()
            results["cases"].setdefault(name, {})[kind] = r
            Path(args.out).write_text(json.dumps(results, indent=1) + "\n")  # kept if a later case dies
    dist.destroy_process_group()
    return 0


def cmd_table(args) -> int:
    measured = json.loads(Path(args.measured).read_text())
    plans = json.loads(plans_file(args.device).read_text())
    rows = []
    for name, m in measured["cases"].items():
        if "error" in m.get("bf16", {}) or "error" in m.get("float8", {"error": "not run"}):
            rows.append({"case": name, "error": m.get("float8", {}).get("error") or m["bf16"]["error"]})
            continue
        p0, p1 = (plans[name][k]["predicted"]["step_time_s"] for k in ("bf16", "float8"))
        b, f = m["bf16"], m["float8"]
        gap = max(abs(x - y) / abs(y) for x, y in zip(f["losses"][-10:], b["losses"][-10:]))
        rows.append({"case": name, "predicted_speedup": p0 / p1, "measured_speedup": b["median_s"] / f["median_s"],
                     "predicted_bf16_s": p0, "predicted_float8_s": p1, "measured_bf16_s": b["median_s"],
                     "measured_float8_s": f["median_s"], "float8_step_error": p1 / f["median_s"] - 1,
                     "loss_gap_last10": gap, "loss_within_tolerance": gap <= LOSS_TOLERANCE,
                     "float8_linears": f["float8_linears"]})
    out = RESULTS / f"float8_gpu_{args.device}"
    out.with_suffix(".json").write_text(json.dumps({"command": f"python3 benchmarks/float8_gpu.py table "
                                                   f"{args.measured} --device {args.device}",
                                                   "device": measured["device"], "torch": measured["torch"],
                                                   "loss_tolerance": LOSS_TOLERANCE, "rows": rows}, indent=1) + "\n")
    lines = ["# Float8 plans on one GPU", "", f"{measured['device']}, torch {measured['torch']}: each case's bf16 "
             f"and float8 plans (both compiled blocks) trained {STEPS} steps on {FIXED_BATCHES} fixed batches; "
             f"step = median after {WARMUP}; loss gap = largest relative gap over the last 10 steps "
             f"(tolerance {LOSS_TOLERANCE:.0%}).", "",
             "| case | float8 Linears | predicted speedup | measured speedup | float8 step error | loss gap |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['error']} |")
            continue
        lines.append(f"| {r['case']} | {r['float8_linears']} | {r['predicted_speedup']:.2f}x | "
                     f"{r['measured_speedup']:.2f}x | {r['float8_step_error']:+.1%} | {r['loss_gap_last10']:.2%} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan")
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("measured")
    for p in (pl, m, t):
        p.add_argument("--device", default="h100-sxm")
        p.add_argument("--cases", default=None)
    args = ap.parse_args()
    return {"plan": cmd_plan, "measure": cmd_measure, "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
