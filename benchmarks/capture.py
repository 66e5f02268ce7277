"""Capture time and peak memory on the largest zoo models.

Each model is captured in a fresh subprocess (so peak RSS is that model's
alone): build on the meta device, then `autopar.capture`. Writes
benchmarks/results/capture.json and capture.md.

    python benchmarks/capture.py            # gpt3_175b, llama3_405b
    python benchmarks/capture.py --models examples/gpt.py:gpt3_13b
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = ["examples/gpt.py:gpt3_175b", "examples/llama.py:llama3_405b"]

_CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch, autopar
from autopar.model_file import load_model
t_import = time.perf_counter() - t0
t1 = time.perf_counter()
loaded = load_model(sys.argv[1], device="meta")
t_build = time.perf_counter() - t1
t2 = time.perf_counter()
graph = autopar.capture(loaded.model, loaded.example_inputs, name=loaded.name)
t_capture = time.perf_counter() - t2
print(json.dumps({
    "model": sys.argv[1], "total_params": graph.total_params, "layers": len(graph.layers),
    "unique_layer_signatures": len({l.signature for l in graph.layers}),
    "graph_nodes": graph.graph.number_of_nodes(), "seq_len": graph.seq_len,
    "import_s": round(t_import, 3), "build_meta_s": round(t_build, 3), "capture_s": round(t_capture, 3),
    "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
}))
"""


def run_one(spec: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, spec], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"capture of {spec} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=DEFAULT)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "capture"))
    args = parser.parse_args(argv)
    results = [run_one(spec) for spec in args.models]
    meta = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
            "limits": {"capture_s": 10, "peak_rss_mib": 2048}}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    lines = ["# Capture benchmark", "",
             f"{meta['date_utc']}, {meta['cpu_count']} CPUs, 1-minute load average {meta['load_avg_1m']} "
             "(the machine is shared; times include contention).", "",
             "| model | params | layers | unique signatures | graph nodes | build on meta (s) | capture (s) | peak RSS (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['total_params']:,} | {r['layers']} | {r['unique_layer_signatures']} | "
                     f"{r['graph_nodes']} | {r['build_meta_s']} | {r['capture_s']} | {r['peak_rss_mib']} |")
    lines += ["", "Limits: capture under 10 s and peak RSS under 2048 MiB per model. "
              "Reproduce: `python benchmarks/capture.py`."]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    ok = all(r["capture_s"] < 10 and r["peak_rss_mib"] < 2048 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
