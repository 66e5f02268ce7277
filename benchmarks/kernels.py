"""Time each fused kernel against eager PyTorch and torch.compile.

    python benchmarks/kernels.py                       # on a GPU: LLM sizes, bf16
    python benchmarks/kernels.py --sizes 8192x4096 --kernels add_rmsnorm,swiglu
    TRITON_INTERPRET=1 python benchmarks/kernels.py --smoke   # CPU: tiny size, proves the script runs

For every kernel in autopar.kernels.REGISTRY and every size MxN (rows x
width), it times forward and forward+backward of: the Triton kernel, the
eager reference, and torch.compile of the reference. Memory-bound kernels
are judged by achieved bandwidth: the bytes the fused kernel must move
(`_ideal_bytes`, each input read once and each output written once) over
its time, against the device's measured copy bandwidth (a large
device-to-device `copy_`, counted as read + write).

Writes benchmarks/results/kernels_<device>.json and .md. `--smoke` (CPU,
interpreter) uses one tiny size and writes to a temporary folder unless
--out is given: interpreter timings say nothing about a GPU and must never
be reported as GPU results.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autopar.kernels import REGISTRY  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LINEAR_CE_HIDDEN = 4096  # hidden size for linear_cross_entropy (N is the vocabulary)


def _shape(name: str, m: int, n: int) -> tuple:
    """REGISTRY make_inputs shape for `m` rows of width `n`."""
    if name == "scaled_masked_softmax":  # (batch, heads, q, k): m rows of n keys
        return (1, max(1, m // n), n, n)
    if name == "linear_cross_entropy":
        return (m, min(LINEAR_CE_HIDDEN, n), n)
    return (m, n)


def _ideal_bytes(name: str, m: int, n: int, e: int) -> tuple[float, float]:
    """(forward, backward) bytes the fused kernel has to move at minimum."""
    mn = m * n * e
    return {
        "swiglu": (3 * mn, 5 * mn),
        "add_layernorm": (4 * mn, 4 * mn), "add_rmsnorm": (4 * mn, 4 * mn),
        "scaled_masked_softmax": (2 * mn, 3 * mn),
        "dropout_add": (3 * mn, 2 * mn),
        "cross_entropy": (mn, 2 * mn),
        "linear_cross_entropy": (float("nan"), float("nan")),  # GEMM-bound: time only
    }[name]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, device, iters: int, warmup: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(device, nbytes: int, iters: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), device, iters, warmup=3)
    return 2 * src.numel() * 4 / t


def _inputs(name, shape, dtype, device):
    args = REGISTRY[name][2](0, shape=shape, dtype=dtype)
    return [a.to(device).requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args]


def _fwd_bwd(fn, args):
    def run():
        out = fn(*args)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    return run


def _fwd(fn, args):
    def run():
        with torch.no_grad():
            fn(*args)
    return run


def bench_one(name, m, n, dtype, device, iters, warmup, with_compile):
    triton_fn, reference_fn, _ = REGISTRY[name]
    args = _inputs(name, _shape(name, m, n), dtype, device)
    impls = {"triton": triton_fn, "eager": reference_fn}
    if with_compile:
        impls["compile"] = torch.compile(reference_fn, dynamic=False)
    row = {"kernel": name, "rows": m, "width": n, "dtype": str(dtype).replace("torch.", "")}
    # A fast wrong kernel is worthless: check the forward at this size first.
    with torch.no_grad():
        got, want = triton_fn(*args), reference_fn(*args)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    row["max_rel_err"] = max(float((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-30))
                             for g, w in zip(got, want))
    for impl, fn in impls.items():
        for phase, make in (("fwd", _fwd), ("fwd_bwd", _fwd_bwd)):
            try:
                row[f"{impl}_{phase}_s"] = _time(make(fn, args), device, iters, warmup)
            except Exception as exc:  # torch.compile without a toolchain, OOM at the largest size...
                row[f"{impl}_{phase}_s"] = None
                row.setdefault("errors", []).append(f"{impl} {phase}: {type(exc).__name__}: {str(exc)[:200]}")
    fwd_b, bwd_b = _ideal_bytes(name, m, n, torch.finfo(dtype).bits // 8)
    if row.get("triton_fwd_s"):
        row["triton_fwd_GBps"] = fwd_b / row["triton_fwd_s"] / 1e9
    if row.get("triton_fwd_bwd_s"):
        row["triton_fwd_bwd_GBps"] = (fwd_b + bwd_b) / row["triton_fwd_bwd_s"] / 1e9
    for impl in impls:  # backward alone: forward + backward less the forward
        if row.get(f"{impl}_fwd_bwd_s") and row.get(f"{impl}_fwd_s"):
            row[f"{impl}_bwd_s"] = max(0.0, row[f"{impl}_fwd_bwd_s"] - row[f"{impl}_fwd_s"])
    for base in ("eager", "compile"):
        if row.get(f"{base}_fwd_bwd_s") and row.get("triton_fwd_bwd_s"):
            row[f"speedup_vs_{base}"] = row[f"{base}_fwd_bwd_s"] / row["triton_fwd_bwd_s"]
        for phase in ("fwd", "bwd"):
            if row.get(f"{base}_{phase}_s") and row.get(f"triton_{phase}_s"):
                row[f"{phase}_speedup_vs_{base}"] = row[f"{base}_{phase}_s"] / row[f"triton_{phase}_s"]
    return row


def _markdown(result) -> str:
    lines = [f"# Fused kernels on {result['device']}", "",
             f"dtype {result['dtype']}; copy bandwidth {result['copy_GBps']:.1f} GB/s (read+write); "
             f"median of {result['iters']} runs; GB/s counts the bytes the fused kernel must move.", ""]
    if result["smoke"]:
        lines += ["**Smoke run (Triton interpreter on CPU): these timings say nothing about GPU speed.**", ""]
    lines += ["| kernel | rows x width | triton fwd+bwd ms | eager ms | compile ms | vs eager | vs compile | "
              "fwd vs eager / compile | bwd vs eager / compile | GB/s fwd | % of copy bw (fwd) | max rel err |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def ms(v):
        return f"{v * 1e3:.3f}" if v else "-"

    def x(v):
        return f"{v:.2f}x" if v else "-"

    for r in result["rows"]:
        gbps = r.get("triton_fwd_GBps")
        frac = f"{100 * gbps / result['copy_GBps']:.0f}%" if gbps and gbps == gbps else "-"
        lines.append(
            f"| {r['kernel']} | {r['rows']}x{r['width']} | {ms(r.get('triton_fwd_bwd_s'))} | {ms(r.get('eager_fwd_bwd_s'))} "
            f"| {ms(r.get('compile_fwd_bwd_s'))} | {x(r.get('speedup_vs_eager'))} | {x(r.get('speedup_vs_compile'))} "
            f"| {x(r.get('fwd_speedup_vs_eager'))} / {x(r.get('fwd_speedup_vs_compile'))} "
            f"| {x(r.get('bwd_speedup_vs_eager'))} / {x(r.get('bwd_speedup_vs_compile'))} "
            f"| {f'{gbps:.1f}' if gbps and gbps == gbps else '-'} | {frac} | {r['max_rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="8192x4096,16384x8192", help="comma-separated ROWSxWIDTH")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--kernels", default="all", help="comma-separated REGISTRY names, or all")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--smoke", action="store_true", help="tiny size on CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; smoke: a temp folder)")
    a = p.parse_args(argv)

    kernels = sorted(REGISTRY) if a.kernels == "all" else a.kernels.split(",")
    unknown = [k for k in kernels if k not in REGISTRY]
    if unknown:
        p.error(f"unknown kernel(s) {unknown}; known: {', '.join(sorted(REGISTRY))}")
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--smoke runs the Triton interpreter: set TRITON_INTERPRET=1 before starting python")
        device, sizes, a.iters, a.warmup = torch.device("cpu"), [(64, 96)], 2, 1
        device_name = "cpu-interpreter"
        out_dir = Path(a.out or tempfile.mkdtemp(prefix="autopar_kernels_smoke_"))
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: this benchmark times GPU kernels (use --smoke with TRITON_INTERPRET=1 "
                    "to check the script end to end on CPU)")
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
        sizes = [tuple(int(x) for x in s.lower().split("x")) for s in a.sizes.split(",")]
        out_dir = Path(a.out or ROOT / "benchmarks" / "results")
    dtype = DTYPES[a.dtype]
    copy_bw = copy_bandwidth(device, 1 << (20 if a.smoke else 30), max(a.iters, 5))
    rows = []
    for name in kernels:
        for m, n in sizes:
            r = bench_one(name, m, n, dtype, device, a.iters, a.warmup, with_compile=not a.no_compile)
            rows.append(r)
            print(f"{name:24s} {m}x{n}: triton {r.get('triton_fwd_bwd_s') or float('nan'):.3e}s "
                  f"eager {r.get('eager_fwd_bwd_s') or float('nan'):.3e}s "
                  f"compile {r.get('compile_fwd_bwd_s') or float('nan'):.3e}s", flush=True)
    result = {"device": device_name, "smoke": a.smoke, "dtype": a.dtype, "copy_GBps": copy_bw / 1e9,
              "iters": a.iters, "torch": torch.__version__, "python": platform.python_version(), "rows": rows}
    slug = "".join(c if c.isalnum() else "_" for c in device_name.lower()).strip("_")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"kernels_{slug}.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    (out_dir / f"kernels_{slug}.md").write_text(_markdown(result))
    print(f"wrote {out_dir / f'kernels_{slug}.json'} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
