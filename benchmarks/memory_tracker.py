"""Predicted peak memory vs torch's FSDPMemTracker, at real layer sizes (issue 13, item 4).

    python3 benchmarks/memory_tracker.py              # every case (about 10 minutes on 2 cores)
    python3 benchmarks/memory_tracker.py --cases NAME # some

For each case, a Llama or a GPT written as people write them
(examples/llama.py, examples/gpt.py) at real width and sequence length, with fewer layers (a rank's peak is linear in
its layer count: the layers differ by nothing), is
1. planned by autopar with the layout pinned (dp 8 on H100s, ZeRO level,
   checkpointing, bf16) -> the predicted peak of rank 0, less the allocator
   fragmentation it reserves (FSDPMemTracker counts tensors, not blocks);
2. built on the meta device and lowered as autopar lowers that plan (one
   fully_shard unit per planned layer with the plan's reshard_after_forward,
   FSDP2 mixed precision bf16 with the plan's reduce dtype (or fp32 in the
   `_fp32reduce` cases, priced with fp32 main gradients), checkpoint_wrapper on the
   layers the plan checkpoints, torch's AdamW as on a GPU: foreach), then
   trained for two steps under FakeTensorMode on rank 0 of a fake process
   group of 8 (no memory, no communication: ../shared notes, memory ground
   truth), with FSDPMemTracker counting every live tensor of the second step.

Calibration: none of these runs set a constant (the loss's gradient rule was
read from one Qwen2 run of the same tracker, docs/cost_model.md section 4).
Writes benchmarks/results/memory_tracker.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 8
LLAMA3_8B = dict(vocab_size=128256, dim=4096, heads=32, kv_heads=8, ffn_hidden=14336)
LLAMA3_70B = dict(vocab_size=128256, dim=8192, heads=64, kv_heads=8, ffn_hidden=28672)
GPT3_6_7B = dict(vocab_size=50257, hidden=4096, heads=32)
# name -> (model file, config fields, micro-batch, zero, checkpoint, reduce dtype)
# reduce "plan": the plan's own (autopar's plans reduce in the training dtype); "fp32":
# torchtitan's reduce_dtype, priced by re-estimating the plan's layout with fp32 main
# gradients and lowered with reduce_dtype=float32
CASES = {}
for model_name, dims, layers, seqs in (("llama3_8b", LLAMA3_8B, 4, (8192, 2048)),
                                       ("llama3_70b", LLAMA3_70B, 2, (4096,))):
    for seq in seqs:
        for zero in (2, 3):
            for ckpt in ("none", "selective", "full"):
                CASES[f"{model_name}_l{layers}_s{seq}_z{zero}_{ckpt}"] = (
                    "llama", dict(dims, layers=layers, seq_len=seq), 1, zero, ckpt, "plan")
# GPT-3 6.7B width (examples/gpt.py: fused qkv, GELU, tied 50257-token head)
for zero, ckpt in ((2, "selective"), (3, "none"), (3, "full")):
    CASES[f"gpt3_6.7b_l4_s2048_z{zero}_{ckpt}"] = ("gpt", dict(GPT3_6_7B, layers=4, seq_len=2048), 1, zero, ckpt,
                                                   "plan")
# fp32 gradient reduction (FSDP2 reduce_dtype=float32, torchtitan's default)
for name, (model_name, dims, layers, seq, zero, ckpt) in {
        "llama3_8b_l4_s2048_z3_none_fp32reduce": ("llama", LLAMA3_8B, 4, 2048, 3, "none"),
        "llama3_8b_l4_s8192_z2_selective_fp32reduce": ("llama", LLAMA3_8B, 4, 8192, 2, "selective"),
        "llama3_70b_l2_s4096_z3_full_fp32reduce": ("llama", LLAMA3_70B, 2, 4096, 3, "full")}.items():
    CASES[name] = (model_name, dict(dims, layers=layers, seq_len=seq), 1, zero, ckpt, "fp32")

MODEL_FILES = {"llama": ("examples/llama.py", "LlamaConfig"), "gpt": ("examples/gpt.py", "GPTConfig")}


def _model(model_name, fields):
    from autopar.model_file import import_model_file

    path, config = MODEL_FILES[model_name]
    mod = import_model_file(str(ROOT / path))
    return mod, getattr(mod, config)(**fields)


def predict(name: str) -> dict:
    import torch

    import autopar
    from autopar.lower.api import captured_with_loss
    from autopar.solve.layout import layout_of
    from cost_models.estimate import estimate
    from cost_models.hardware import ClusterSpec
    from cost_models.layout import Layout

    model_name, fields, mb, zero, ckpt, reduce = CASES[name]
    mod, cfg = _model(model_name, fields)
    with torch.device("meta"):
        model = mod.build_model(cfg)
    cluster = ClusterSpec(nodes=1, gpus_per_node=WORLD, device="h100-sxm")
    captured = captured_with_loss(model, lambda b: mod.example_inputs(b, cfg), mod.loss_fn)
    plan = autopar.plan(captured, cluster, global_batch_size=WORLD * mb, precision="bf16", fusion=False,
                        module=model, constraints=dict(dp=WORLD, tp=1, pp=1, zero=zero, checkpoint=ckpt,
                                                       micro_batch=mb))
    d = plan.to_dict()
    if reduce == "fp32":  # the same layout with fp32 main gradients, as the lowering below runs it
        layout = Layout(**{**layout_of(plan).to_dict(), "main_grads": "fp32"})
        est = estimate(captured, layout, cluster)
        d["predicted"]["peak_memory_bytes"] = list(est.peak_memory_bytes)
        d["predicted"]["memory_breakdown"] = list(est.memory_breakdown)
        d.setdefault("assumptions", {}).setdefault("cost_model", {})["main_grads"] = "fp32"
    return d


def track(name: str, plan: dict) -> dict:
    """Rank 0's live tensors over the second step, by FSDPMemTracker category."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autopar.lower.checkpointing import wrap

    model_name, fields, mb, _, _, _ = CASES[name]
    mod, cfg = _model(model_name, fields)
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    mesh = init_device_mesh("cpu", (WORLD,))
    with torch.device("meta"):
        model = mod.build_model(cfg)
    # the plan's own reduce dtype, as autopar.lower.data_parallel.mixed_precision reads it
    grads = ((plan.get("assumptions") or {}).get("cost_model") or {}).get("main_grads") or "fp32"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None if grads == "same" else torch.float32)
    choices = [c for s in plan["stages"] for c in s["layers"]]
    for c in choices:  # as autopar.lower.checkpointing: each checkpointed layer's one module wrapped
        if c["checkpoint"] != "none" and len(c["module_paths"]) == 1:
            parent, _, leaf = c["module_paths"][0].rpartition(".")
            holder = model.get_submodule(parent) if parent else model
            holder._modules[leaf] = wrap(holder._modules[leaf], c["checkpoint"])
    # as autopar.lower.data_parallel.apply_fsdp: a layer holding one end of a tied weight is
    # left to the root unit (one parameter lives in one FSDP unit)
    owners: dict = {}
    for c in choices:
        for path in c["module_paths"]:
            for p in model.get_submodule(path).parameters():
                owners.setdefault(id(p), set()).add(path)
    # One unit per layer, also when the layer is several modules (the head's final norm and
    # output Linear: one all-gather and one reduce-scatter, as the lowering groups them)
    for c in choices:
        modules = [model.get_submodule(path) for path in c["module_paths"]]
        if any(len(owners[id(p)]) > 1 for m in modules for p in m.parameters()):
            continue
        modules = [m for m in modules if any(True for _ in m.parameters())]
        if modules:
            fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, mp_policy=mp,
                        reshard_after_forward=c["zero"] >= 3)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=any(c["zero"] >= 3 for c in choices))
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)  # a GPU's default
        x = torch.randint(0, cfg.vocab_size, (mb, cfg.seq_len))
        y = torch.randint(0, cfg.vocab_size, (mb, cfg.seq_len))

        def step():
            opt.zero_grad(set_to_none=True)
            mod.loss_fn(model(x), y).backward()
            opt.step()
        step()  # the first step creates the optimizer state (its peak is not a steady step's)
        tracker = FSDPMemTracker(model, opt)
        with tracker:
            step()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    dist.destroy_process_group()
    return {str(k).split(".")[-1]: float(v) for k, v in peak.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=None)
    ap.add_argument("--track", default=None, help=argparse.SUPPRESS)  # one case, in its own process
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "memory_tracker"))
    args = ap.parse_args()
    if args.track:
        plan = json.loads(Path(args.track).read_text())
        print(json.dumps(track(plan["__case__"], plan)))
        return 0
    names = args.cases.split(",") if args.cases else list(CASES)
    rows = []
    for name in names:
        plan = predict(name)
        pred = plan["predicted"]
        breakdown = pred["memory_breakdown"][0]
        allocated = pred["peak_memory_bytes"][0] - breakdown.get("fragmentation", 0.0)
        path = Path(args.out + f".{name}.plan.json")
        path.write_text(json.dumps({**plan, "__case__": name}))
        # each tracked step in its own process: a fake process group per world
        proc = subprocess.run([sys.executable, __file__, "--track", str(path)], capture_output=True, text=True,
                              timeout=1800)
        path.unlink()
        if proc.returncode != 0:
            rows.append({"case": name, "error": proc.stderr.strip().splitlines()[-1][:300]})
            print(f"{name}: {rows[-1]['error']}", file=sys.stderr)
            continue
        peak = json.loads(proc.stdout.strip().splitlines()[-1])
        row = {"case": name, "predicted_bytes": allocated, "tracked_bytes": peak["Total"],
               "error": allocated / peak["Total"] - 1, "tracked": peak, "predicted_breakdown": breakdown,
               # FSDP2's persistent states: fp32 parameter shards + AdamW's two moments, the
               # 4 + 8 B/param/dp the estimate books for them (docs/cost_model.md section 4)
               "predicted_sharded_states": 12 * plan["model"]["total_params"] / WORLD,
               "tracked_sharded_states": peak.get("SHARDED_PARAM", 0.0) + peak.get("OPT", 0.0)}
        rows.append(row)
        print(f"{name:34s} predicted {allocated / 2**30:7.2f} GiB  tracked {peak['Total'] / 2**30:7.2f} GiB  "
              f"{row['error']:+.1%}", file=sys.stderr, flush=True)
    write(rows, args)
    return 0


def write(rows: list, args) -> None:
    ok = [r for r in rows if isinstance(r.get("error"), float)]
    errs = [abs(r["error"]) for r in ok]
    summary = {"cases": len(rows), "compared": len(ok),
               "median_abs_error": statistics.median(errs) if errs else None,
               "worst_abs_error": max(errs) if errs else None, "within_5pct": sum(e <= 0.05 for e in errs)}
    Path(args.out + ".json").write_text(json.dumps({"command": "python3 benchmarks/memory_tracker.py",
                                                    "summary": summary, "rows": rows}, indent=1) + "\n")
    gib = 2 ** 30
    lines = ["# Predicted peak memory vs FSDPMemTracker (rank 0 of 8, second step)", "",
             "Generated by `python3 benchmarks/memory_tracker.py`. Llama 3 and GPT-3 widths (examples/llama.py, "
             "examples/gpt.py) with fewer layers, bf16 with FSDP2 mixed precision, dp 8, micro-batch 1, AdamW (foreach). Predicted = the plan's "
             "peak less the allocator fragmentation it reserves. Tracked = torch's FSDPMemTracker under "
             "FakeTensorMode, every live tensor.", "",
             "| case | predicted GiB | tracked GiB | error | tracked: params | grads | optimizer | activations | "
             "temporaries | FSDP buffers |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not isinstance(r.get("error"), float):
            lines.append(f"| {r['case']} | - | - | {r['error']} | | | | | | |")
            continue
        t = r["tracked"]
        params = t.get("SHARDED_PARAM", 0) + t.get("UNSHARDED_PARAM", 0)
        grads = t.get("SHARDED_GRAD", 0) + t.get("UNSHARDED_GRAD", 0)
        buffers = t.get("ALL_GATHER", 0) + t.get("REDUCE_SCATTER", 0) + t.get("BUFFER", 0)
        lines.append(f"| {r['case']} | {r['predicted_bytes'] / gib:.2f} | {r['tracked_bytes'] / gib:.2f} | "
                     f"{r['error']:+.1%} | {params / gib:.2f} | {grads / gib:.2f} | {t.get('OPT', 0) / gib:.2f} | "
                     f"{t.get('ACT', 0) / gib:.2f} | {t.get('TEMP', 0) / gib:.2f} | {buffers / gib:.2f} |")
    if errs:
        lines += ["", f"{len(ok)} cases: median |error| {summary['median_abs_error']:.1%}, worst "
                      f"{summary['worst_abs_error']:.1%}, {summary['within_5pct']} within 5% (the issue's target)."]
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
