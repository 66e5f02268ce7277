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
- `tp_pp_runs.csv` (gathered with tp_pp_runs.md, which names every row's file and
  commit): Megatron-style layouts, tensor and pipeline parallel. NVIDIA's DGX
  Cloud benchmarking recipes (NeMo 24.09 / 24.11 on DGX H100: GPT-3 175B,
  Nemotron-4 15B and 340B), NeMo Megatron's 2022 GPT-3 175B table (DGX A100),
  Megatron-LM's README GPT-3 175B run, torchtitan's 2D (FSDP x TP) Llama 3.1 405B.
  Rows the model cannot price are listed with the reason and left out: context
  parallelism (no cp in the Layout), torch.compile / async TP (no compiled path),
  a fine-tuning row without its micro-batch.

- `validation_more_runs.csv` (sources, commits and what each leaves unstated in
  validation_more_runs.md): FlagOpen/FlagPerf (Megatron-core / Megatron-DeepSpeed on
  H100 and A100-40GB), torchtitan's Llama 2 FSDP2 table, TinyLlama (FSDP, A100-40GB),
  IBM and Meta's FSDP blog table (Llama 2 on 128 A100 and 96 H100 over 400 / 800 Gb/s per node).

The validation set itself (issue 35) is a subsample of these rows with rules that can
fail: at least six sources, none more than a third of the rows (llm-foundry and
dgxc-benchmarking thinned at a fixed stride), results per source, scale band and
family, and a bound per band (benchmarks/validation_set.py; its history in
benchmarks/reference/validation_history.md).

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
sys.path.insert(0, str(ROOT / "benchmarks"))

from cost_models.analytic import gpt, llama, transformer  # noqa: E402
from cost_models.estimate import estimate  # noqa: E402
from cost_models.devices import LinkProfile, get_link  # noqa: E402
from cost_models.hardware import ClusterSpec  # noqa: E402
from cost_models.layout import Layout  # noqa: E402

import validation_set as S  # noqa: E402

REFERENCE = ROOT / "benchmarks" / "reference"
MPT_CSV = REFERENCE / "llm_foundry_mpt_throughput.csv"
TP_PP_CSV = REFERENCE / "tp_pp_runs.csv"

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


def _tp_pp_model(row: dict):
    """The row's model from its shape columns, built as its code base writes it."""
    name, h, a, layers = row["model"], int(row["hidden"]), int(row["heads"]), int(row["layers"])
    kv, ffn, seq, vocab = int(row["kv_heads"]), int(row["ffn_hidden"]), int(row["seq_len"]), int(row["vocab"])
    system = row["system"]
    if name.startswith("GPT3"):
        # GPT-3 in Megatron / NeMo: LayerNorm, GELU, biases, learned positions, tied head. Megatron
        # 2021-22 ran attention unfused with dropout; NeMo 24.x runs Transformer Engine's fused
        # (cuDNN flash) attention without dropout.
        old = "2022" in system or "2021" in system
        return gpt(name, hidden=h, heads=a, layers=layers, seq_len=seq, vocab_size=vocab,
                   attention="unfused" if old else "flash", dropout=old)
    if name.startswith("Nemotron4"):
        # Nemotron-4: squared-ReLU MLP (not gated), no biases, RoPE, GQA, LayerNorm, untied head
        return transformer(name, hidden=h, heads=a, layers=layers, seq_len=seq, vocab_size=vocab, kv_heads=kv,
                           ffn_hidden=ffn, gated_mlp=False, bias=False, rope=True, learned_positions=False,
                           tied=False, fused_qkv=True)
    # Llama 3 as torchtitan writes it (eager PyTorch ops, op-level SAC)
    return llama(name, hidden=h, heads=a, layers=layers, seq_len=seq, vocab_size=vocab, kv_heads=kv, ffn_hidden=ffn,
                 eager=True, sac="torchtitan")


def _tp_pp_skip(row: dict) -> str | None:
    if int(row["cp"] or 1) > 1:
        return "context parallelism (cp 2): the Layout has no cp axis"
    if "compile" in row["system"]:
        return "torch.compile (and async TP): the model prices eager kernels"
    if not row["micro_batch"]:
        return "the source gives no micro-batch size"
    if "does NOT state the layout" in row["notes"]:
        return ("the source publishes the throughput without its layout (tp, pp and batch were read from a "
                "config file of the same commit, an assumption)")
    return None


def tp_pp_rows(path: Path = TP_PP_CSV) -> list[dict]:
    """One spec per bf16/fp16 row of tp_pp_runs.csv; rows the model cannot price come back with `skip`."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    specs = []
    for row in rows:
        tp, pp, gpus = int(row["tp"]), int(row["pp"]), int(row["gpus"])
        label = f"{row['model']} {gpus}x {row['hardware'].split()[0]} (tp{tp} pp{pp} dp{row['dp']}) [{row['system']}]"
        why = _tp_pp_skip(row)
        if why:
            specs.append({"label": label, "skip": why})
            continue
        dp, mb, gbs = int(row["dp"]), int(row["micro_batch"]), int(row["global_batch"])
        vp = int(row["vp"] or 1)
        system, recompute = row["system"], row["recompute"].split()[0] if row["recompute"] else None
        layers = int(row["layers"])
        common = dict(tp=tp, pp=pp, dp=dp, micro_batch_size=mb, num_micro_batches=gbs // (dp * mb))
        if system.startswith("torchtitan"):
            # FSDP2 over dp x DTensor TP, eager; fp32 reduce-scatter (torchtitan's default)
            layout = Layout(**common, zero=3, sequence_parallel=True, main_grads="fp32", checkpoint=recompute)
            cluster, assumed = f"grand-teton-h100:{gpus // 8}", ("FSDP2 (ZeRO-3) x DTensor TP with sequence "
                                                                "parallel, eager; fp32 reduce-scatter")
        elif "A100" in row["hardware"]:
            # Megatron-LM 2021-22: plain DP (no distributed optimizer), 1F1B, batched blocking p2p,
            # fp32 main gradients fused into the weight-gradient GEMM
            layout = Layout(**common, schedule="1f1b", zero=0, checkpoint=recompute, p2p_blocking=True,
                            main_grads="fp32", sequence_parallel=row["sequence_parallel"] == "True",
                            precision="fp16" if row["precision"] == "fp16" else "bf16")
            cluster, assumed = f"dgx-a100:{gpus // 8}", ("Megatron 1F1B, blocking p2p, plain DP, fp32 main "
                                                         "gradients; unfused attention with dropout (2022)")
        else:
            # NeMo 24.x (Megatron-core): distributed optimizer (ZeRO-1), fp32 main gradients,
            # sequence parallel with tp, interleaved 1F1B when vp > 1; recompute unstated: the least
            # that fits, as a practitioner (and the planner) would pick
            # and Transformer Engine's TP communication overlap, which NeMo's recipes for these
            # models enable (userbuffers configs in nemo/collections/llm/recipes/tp_overlap_configs)
            layout = Layout(**common, schedule="interleaved" if vp > 1 and pp > 1 else "1f1b",
                            virtual_stages=vp if pp > 1 else 1, zero=1, main_grads="fp32",
                            sequence_parallel=tp > 1, checkpoint=recompute, tp_comm_overlap=True)
            cluster, assumed = f"dgx-h100:{gpus // 8}", ("NeMo (Megatron-core): distributed optimizer (ZeRO-1), "
                                                         "fp32 main gradients, SP, TE fused attention, TE TP "
                                                         "communication overlap; recompute unstated: the least "
                                                         "that fits")
        metric = row["metric"]
        specs.append({"label": label, "source": row["system"], "family": "tp/pp", "table": row["system"],
                      "model": lambda row=row: _tp_pp_model(row), "layout": layout,
                      "cluster": ClusterSpec.resolve(cluster), "published": float(row["value"]),
                      "metric": metric, "assumed": assumed, "layers": layers})
    return specs


def _price(model, layout: Layout, cluster: ClusterSpec):
    """estimate(), choosing the least recomputation that fits when the layout leaves it unstated."""
    if layout.checkpoint is not None:
        return layout, estimate(model, layout, cluster)
    for mode in ("none", "selective", "full"):
        trial = Layout(**{**layout.to_dict(), "checkpoint": mode})
        est = estimate(model, trial, cluster)
        if est.fits:
            break
    return trial, est


def _predicted(est, layout: Layout, metric: str) -> float:
    return {"tokens_per_s_per_gpu": est.tokens_per_s / layout.world_size,
            "hardware_tflops_per_gpu": est.hardware_tflops_per_gpu,
            "model_tflops_per_gpu": est.tflops_per_gpu}[metric]


def _more_cluster(row: dict, gpus: int) -> ClusterSpec:
    """The row's cluster preset; where the source states a slower fabric per node than the preset's
    (fabric_gbps_per_node), that fabric as a user link: the stated Gb/s per node shared by its 8 GPUs,
    with roce-400's bus efficiency and latency (the source names RDMA, not the transport)."""
    base = ClusterSpec.resolve(f"{row['cluster']}:{max(1, gpus // 8)}")
    if not row.get("fabric_gbps_per_node"):
        return base
    roce = get_link("roce-400")
    name = f"{row['fabric_gbps_per_node']}g-per-node"
    link = LinkProfile(name=name, bandwidth=float(row["fabric_gbps_per_node"]) * 1e9 / 8 / base.gpus_per_node,
                       bus_efficiency=roce.bus_efficiency, latency_s=roce.latency_s,
                       source=f"{row['source']}: {row['fabric_gbps_per_node']} Gb/s per node")
    return ClusterSpec(nodes=base.nodes, gpus_per_node=base.gpus_per_node, device=base.device,
                       intra_node_link=base.intra_node_link, inter_node_link=name, links={name: link},
                       name=f"{base.device} x{gpus}, {row['fabric_gbps_per_node']} Gb/s per node")


def more_rows(path: Path = S.MORE_CSV) -> list[dict]:
    """One spec per row of validation_more_runs.csv (FlagPerf, torchtitan's Llama 2 table, TinyLlama);
    rows the model cannot price come back with `skip` (the CSV says why)."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    specs = []
    for row in rows:
        gpus, tp, pp, dp = int(row["gpus"]), int(row["tp"]), int(row["pp"]), int(row["dp"])
        label = (f"{row['model']} {gpus}x {row['hardware'].split('-')[0]} (tp{tp} pp{pp} dp{dp} mb{row['micro_batch']} "
                 f"ac {row['recompute'] or 'unstated'}) [{row['source']}]")
        if row["skip"]:
            specs.append({"label": label, "skip": row["skip"]})
            continue
        mb, gbs = int(row["micro_batch"]), int(row["global_batch"])
        torchtitan = row["engine"].startswith("torchtitan")
        megatron = "megatron" in row["engine"].lower()
        # torchtitan and Megatron reduce gradients in fp32; Lightning's and IBM's FSDP setups state no
        # reduce dtype (bf16 assumed, the assumed column says so); their AdamW is torch's per-tensor loop
        layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=mb, num_micro_batches=gbs // (dp * mb),
                        zero=int(row["zero"]), checkpoint=row["recompute"] or None,
                        sequence_parallel=row["sequence_parallel"] == "True",
                        main_grads="fp32" if (torchtitan or megatron) else "same",
                        optimizer_impl="fused" if (torchtitan or megatron) else "foreach")

        def model(row=row, eager="eager" in row["engine"], sac="torchtitan" if torchtitan else "autopar"):
            return llama(row["model"], hidden=int(row["hidden"]), heads=int(row["heads"]), layers=int(row["layers"]),
                         seq_len=int(row["seq_len"]), vocab_size=int(row["vocab"]), kv_heads=int(row["kv_heads"]),
                         ffn_hidden=int(row["ffn_hidden"]), eager=eager, sac=sac)
        specs.append({"label": label, "source": row["source"], "family": "tp/pp" if tp * pp > 1 else "fsdp",
                      "table": f"{row['source']} {row['source_file']}", "model": model, "layout": layout,
                      "cluster": _more_cluster(row, gpus),
                      "published": float(row["value"]), "metric": row["metric"],
                      "assumed": f"{row['source']} ({row['source_file']} at {row['source_commit']}): {row['assumed']}"})
    return specs


def all_specs() -> list[dict]:
    return mpt_rows() + tp_pp_rows() + more_rows()


def price(spec: dict) -> dict:
    """One priced row: the spec's layout on its cluster, compared in the unit the source publishes."""
    model = spec["model"]()
    layout, est = _price(model, spec["layout"], spec["cluster"])
    metric = spec.get("metric", "tokens_per_s_per_gpu")
    predicted = _predicted(est, layout, metric)
    return {"run": spec["label"], "source": spec["source"], "family": spec["family"], "metric": metric,
            "table": spec["table"], "published": spec["published"], "predicted": predicted,
            "error": predicted / spec["published"] - 1.0, "mfu": est.mfu, "fits": est.fits,
            "step_time_s": est.step_time_s, "peak_memory_gib": max(est.peak_memory_bytes) / 2**30,
            "assumed": spec["assumed"], "gpus": layout.world_size, "set_source": S.source_of(spec),
            "set_family": S.family_of(layout), "band": S.band_of(layout.world_size),
            "layout": {k: v for k, v in layout.to_dict().items() if v not in (None, {}, False)},
            "time_breakdown": est.time_breakdown}


def run() -> tuple[list[dict], list[dict]]:
    """Every priceable row of every source (the set is a subsample of these: validation_set)."""
    results, skipped = [], []
    for spec in all_specs():
        if spec.get("skip"):
            skipped.append({"run": spec["label"], "why": spec["skip"]})
        else:
            results.append(price(spec))
    return results, skipped


def validation_set(priced: list[dict] | None = None) -> tuple[list[dict], dict]:
    """The validation set (validation_set.select), priced. Only the kept rows are priced, or
    taken from `priced` (run()'s results) when given."""
    specs = [s for s in all_specs() if not s.get("skip")]
    if len({s["label"] for s in specs}) != len(specs):
        raise ValueError("two validation rows share a label: the set is matched to prices by label")
    kept, counts = S.select(specs)
    by_label = {r["run"]: r for r in priced or []}
    return [by_label.get(spec["label"]) or price(spec) for spec in kept], counts


def summary(rows: list[dict]) -> dict:
    if not rows:
        return {"rows": 0}
    errors = [r["error"] for r in rows]
    return {"rows": len(rows), "median_abs": statistics.median(abs(e) for e in errors),
            "signed_median": statistics.median(errors), "within_10": sum(abs(e) <= 0.10 for e in errors)}


MEDIAN_TARGET = 0.10  # issue 13: median |error| over the validation set
FAMILY_GAP_TARGET = 0.05  # issue 13: signed medians of the fsdp and tp/pp rows within 5 points


def render(results: list[dict], skipped: list[dict], set_rows: list[dict], counts: dict) -> str:
    head = ["# Validation set: published runs that set no constant, predicted vs published", "",
            "Generated by `python3 benchmarks/validation_runs.py` (writes this file and validation_runs.json).", ""]
    return "\n".join(head + S.render(set_rows, counts)) + "\n" + _render_all(results, skipped)


def _render_all(results: list[dict], skipped: list[dict]) -> str:
    allst = summary(results)
    fam = {f: summary([r for r in results if r["family"] == f]) for f in ("fsdp", "tp/pp")}
    gap = abs(fam["fsdp"]["signed_median"] - fam["tp/pp"]["signed_median"])
    lines = [
        "## Every priced row, before the per-source cap (issue 13's view)",
        "",
        "From `benchmarks/reference/llm_foundry_mpt_throughput.csv`, `benchmarks/reference/tp_pp_runs.csv` and",
        "`benchmarks/reference/validation_more_runs.csv` (sources, commits and caveats: `benchmarks/reference/README.md`,",
        "`benchmarks/reference/tp_pp_runs.md`, `benchmarks/reference/validation_more_runs.md`). Every row is priced in the unit it publishes. These runs are",
        "**validation** data: no constant of the cost model was set from them (docs/cost_model.md section 10 says",
        "what was changed after they were first priced, and from which source).",
        "",
        f"**All {allst['rows']} rows: median |error| {allst['median_abs']:.1%} (target <= {MEDIAN_TARGET:.0%}), signed "
        f"{allst['signed_median']:+.1%}, {allst['within_10']} within 10%.**",
        "",
        "| family | rows | median abs error | signed median | within 10% |",
        "|---|---:|---:|---:|---:|",
    ]
    for f, st in fam.items():
        lines.append(f"| {f} | {st['rows']} | {st['median_abs']:.1%} | {st['signed_median']:+.1%} | {st['within_10']} |")
    lines += ["", f"Signed medians of the two families differ by {gap * 100:.1f} points (target <= "
                  f"{FAMILY_GAP_TARGET * 100:.0f}).", "", "| source / table | rows | median abs error | signed median |",
              "|---|---:|---:|---:|"]
    for table in sorted({r["table"] for r in results}):
        st = summary([r for r in results if r["table"] == table])
        lines.append(f"| {table} | {st['rows']} | {st['median_abs']:.1%} | {st['signed_median']:+.1%} |")
    lines += ["", "| run | family | metric | published | predicted | error | MFU | checkpoint | fits |",
              "|---|---|---|---:|---:|---:|---:|---|---|"]
    for r in results:
        lines.append(f"| {r['run']} | {r['family']} | {r['metric']} | {r['published']:.1f} | {r['predicted']:.1f} | "
                     f"{r['error']:+.1%} | {r['mfu']:.1%} | {r['layout'].get('checkpoint', 'none')} | "
                     f"{'yes' if r['fits'] else 'NO'} |")
    lines += ["", "Assumed, per source (what the source leaves unstated, filled with that code base's practice):", ""]
    for source in sorted({r["source"] for r in results}):
        lines.append(f"- {source}: {next(r['assumed'] for r in results if r['source'] == source)}")
    lines += ["", f"Listed and not priced ({len(skipped)}):", ""]
    for s in skipped:
        lines.append(f"- {s['run']}: {s['why']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    results, skipped = run()
    set_rows, counts = validation_set(results)
    for key in ("set_source", "band", "set_family"):
        for name, st in S.summarize(set_rows, key).items():
            print("set", key, name, st)
    print("set verdict", S.check(set_rows) or "holds")
    for group in sorted({r["table"] for r in results}):
        print(group, summary([r for r in results if r["table"] == group]))
    for family in ("fsdp", "tp/pp"):
        print(family, summary([r for r in results if r["family"] == family]))
    print("all", summary(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "validation_runs.md").write_text(render(results, skipped, set_rows, counts))
    (args.out / "validation_runs.json").write_text(json.dumps({"set": [r["run"] for r in set_rows], "set_counts": counts,
                                                              "results": results, "skipped": skipped}, indent=1,
                                                              sort_keys=True, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
