"""Validation set: published training runs that set no constant, priced and compared.

The cost model's constants come from datasheets, micro-benchmarks and the
calibration set (benchmarks/published_runs.py). The runs here were added
afterwards, from public sources, and the table below is what the model
predicts for them as it stands: no constant, default or assumption was chosen
by looking at these errors (docs/cost_model.md, "Calibration and validation").

Sources (each file in benchmarks/reference/ names its origin and commit):
- `llm_foundry_mpt_throughput.csv`: MosaicML's MPT throughput tables
  (mosaicml/llm-foundry scripts/train/benchmarking/README.md): 125M to 70B,
  8 to 512 A100-40GB / A100-80GB / H100, PyTorch FSDP (Composer), bf16.
  The fp8 rows are listed and left out (the model has no fp8 GEMM path).

Each row is priced in the unit it publishes: tokens per second per GPU.
Families: "fsdp" (data parallel, sharded or not) and "tp/pp" (tensor or
pipeline parallel > 1); the acceptance asks their signed medians to agree.

    python3 benchmarks/validation_runs.py [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cost_models.analytic import gpt  # noqa: E402
from cost_models.estimate import estimate  # noqa: E402
from cost_models.hardware import ClusterSpec  # noqa: E402
from cost_models.layout import Layout  # noqa: E402

REFERENCE = ROOT / "benchmarks" / "reference"
MPT_CSV = REFERENCE / "llm_foundry_mpt_throughput.csv"

# MPT shapes: llm-foundry scripts/train/yamls/pretrain/mpt-<size>.yaml (d_model, n_heads,
# n_layers); expansion ratio 4, vocabulary 50368, and the MPT config defaults of the time:
# learned positions, LayerNorm and linear biases (no_bias False), tied head. The
# published NumParams checks this: 7b at s=2048 is 6,658,859,008 (tested).
MPT_SHAPES = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
              "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
              "70b": (8192, 64, 80)}
MPT_VOCAB = 50368
# What each table ran on. MosaicML's tables name the A100 fabric (1600 Gb/s RoCE per node =
# 200 Gb/s per GPU); the H100 tables do not: one 400 Gb/s NIC per GPU (DGX H100 / HGX
# reference design) is assumed.
MPT_CLUSTERS = {
    "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": ("a100-80g", "nvlink3", "roce-200"),
    "A100 40GB with 1600 Gbps node-node interconnect (RoCE)": ("a100-40g", "nvlink3", "roce-200"),
    "H100 80GB BF16": ("h100-sxm", "nvlink4", "ib-ndr"),
    "H100 80GB BF16 (Large Scale, >= 128 GPUs)": ("h100-sxm", "nvlink4", "ib-ndr"),
}
MPT_ASSUMED = ("PyTorch FSDP1 (Composer): FULL_SHARD = ZeRO-3, SHARD_GRAD_OP = ZeRO-2, one unit per block; "
               "activation checkpointing = full per block; attention by the 2022 Triton flash kernel (submit_benchmarks.py's attn_impl default 'triton'); mixed precision DEFAULT "
               "reduces in fp32, PURE in bf16; Composer's decoupled AdamW, a per-tensor loop (priced as foreach)")


def mpt_model(size: str, seq_len: int):
    hidden, heads, layers = MPT_SHAPES[size]
    return gpt(f"MPT-{size}", hidden=hidden, heads=heads, layers=layers, seq_len=seq_len, vocab_size=MPT_VOCAB,
               attention="flash-triton", dropout=False)


def mpt_rows(path: Path = MPT_CSV) -> list[dict]:
    """One spec per bf16 row of the MPT tables; fp8 rows come back with `skip` set."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    specs = []
    for row in rows:
        gpus, seq = int(row["gpus"]), int(row["seq_len"])
        label = f"MPT-{row['model']} s{seq} {gpus}x {row['gpu']} mb{row['micro_batch']}x{row['grad_accum']}"
        if "fp8" in row["precision"]:
            specs.append({"label": label, "skip": "fp8 (no fp8 GEMM path in the model)"})
            continue
        device, intra, inter = MPT_CLUSTERS[row["table"]]
        cluster = ClusterSpec(nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus), device=device,
                              intra_node_link=intra, inter_node_link=inter, name=f"{device} x{gpus}")
        layout = Layout(dp=gpus, micro_batch_size=int(row["micro_batch"]), num_micro_batches=int(row["grad_accum"]),
                        zero=3 if row["sharding"] == "FULL_SHARD" else 2,
                        checkpoint="full" if row["activation_checkpointing"] == "True" else "none",
                        main_grads="fp32" if row["mp_mode"] == "DEFAULT" else "same", optimizer_impl="foreach")
        specs.append({"label": label, "source": "llm-foundry MPT", "family": "fsdp", "table": row["table"],
                      "model": lambda size=row["model"], seq=seq: mpt_model(size, seq), "layout": layout,
                      "cluster": cluster, "published": float(row["tokens_per_s_per_gpu"]),
                      "num_params": int(row["num_params"]), "assumed": MPT_ASSUMED})
    return specs


def run() -> tuple[list[dict], list[dict]]:
    results, skipped = [], []
    for spec in mpt_rows():
        if spec.get("skip"):
            skipped.append({"run": spec["label"], "why": spec["skip"]})
            continue
        model, layout = spec["model"](), spec["layout"]
        est = estimate(model, layout, spec["cluster"])
        predicted = est.tokens_per_s / layout.world_size
        results.append({"run": spec["label"], "source": spec["source"], "family": spec["family"],
                        "table": spec["table"], "published": spec["published"], "predicted": predicted,
                        "error": predicted / spec["published"] - 1.0, "mfu": est.mfu, "fits": est.fits,
                        "step_time_s": est.step_time_s, "peak_memory_gib": max(est.peak_memory_bytes) / 2**30,
                        "hidden": model.layers[1].attrs.get("hidden") if model.layers[1].attrs else None,
                        "layout": {k: v for k, v in layout.to_dict().items() if v not in (None, {}, False)},
                        "time_breakdown": est.time_breakdown})
    return results, skipped


def summary(rows: list[dict]) -> dict:
    if not rows:
        return {"rows": 0}
    errors = [r["error"] for r in rows]
    return {"rows": len(rows), "median_abs": statistics.median(abs(e) for e in errors),
            "signed_median": statistics.median(errors), "within_10": sum(abs(e) <= 0.10 for e in errors)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    results, skipped = run()
    for group in sorted({r["table"] for r in results}):
        print(group, summary([r for r in results if r["table"] == group]))
    print("all", summary(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "validation_runs.json").write_text(json.dumps({"results": results, "skipped": skipped}, indent=1,
                                                              sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
