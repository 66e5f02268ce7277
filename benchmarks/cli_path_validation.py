"""The validation set priced the way a user of the CLI prices it: captured models.

`benchmarks/validation_runs.py` prices each published run with an analytic
model of its architecture and the engine fields of the code base that ran it.
A user (or a held-out check) instead hands `autopar plan` a model file and pins
the layout with flags. This benchmark prices the same rows that way: the model
written as people write it (examples/gpt.py, examples/llama.py at the published
shape), captured on meta tensors, and the layout built by the planner's own
`candidate_layout`, twice:

- **autopar engine**: what `autopar plan` prints with every layout flag pinned
  and no engine flag: the run as autopar's own program would make it (FSDP2
  ZeRO 2 under tp / pp, foreach AdamW, gradients in bf16, DTensor TP exposed,
  SDPA's FlashAttention-2);
- **run's engine**: the same pins plus the engine flags that say how the
  published run executed (`--engine megatron --tp-comm-overlap` for NeMo,
  `--engine pytorch --main-grads fp32 --attention-kernel flash-triton` for
  MosaicML's MPT, ...), which is what comparing against that run needs.

Nothing here sets a constant; the engine fields are the ones the validation
script already states for each source (its `assumed` column).

    python3 benchmarks/cli_path_validation.py [--out benchmarks/results] [--limit N]

Nemotron-4 is built with transformers' NemotronForCausalLM at the published
shape. The tp collectives are capture's dataflow pattern (the
CLI also counts DTensor's on the lowering for the autopar engine: GPT's fused
qkv then issues two all-gathers more per block backward, not priced here).
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402

import gpt as gpt_example  # noqa: E402  (examples/gpt.py)
import llama as llama_example  # noqa: E402  (examples/llama.py)
import validation_runs as vr  # noqa: E402

from cost_models.layout import Layout  # noqa: E402

from autopar.engine import AUTOPAR, Engine, engine_from_options, with_engine  # noqa: E402
from autopar.solve.fusion_costs import charge_fusions, plan_fusions  # noqa: E402
from autopar.solve.layout import candidate_layout, root_held_layers  # noqa: E402
from autopar.solve.planner import model_spec  # noqa: E402
from autopar.solve.search_space import Candidate  # noqa: E402

MPT_ATTENTION = "flash-triton"  # MosaicML's attn_impl: triton (validation_runs.MPT_ASSUMED)


def _gpt(hidden, heads, layers, vocab, seq, **kw):
    cfg = gpt_example.GPTConfig(hidden=hidden, heads=heads, layers=layers, vocab_size=vocab, seq_len=seq, **kw)
    return gpt_example.GPT(cfg), gpt_example.example_inputs(1, cfg)


def _csv_shapes() -> dict:
    with open(vr.TP_PP_CSV) as f:
        return {r["model"]: r for r in csv.DictReader(f)}


def _nemotron(r: dict):
    from transformers import NemotronConfig, NemotronForCausalLM

    seq, vocab = int(r["seq_len"]), int(r["vocab"])
    cfg = NemotronConfig(hidden_size=int(r["hidden"]), num_hidden_layers=int(r["layers"]),
                         num_attention_heads=int(r["heads"]), num_key_value_heads=int(r["kv_heads"]),
                         intermediate_size=int(r["ffn_hidden"]), vocab_size=vocab, max_position_embeddings=seq)
    return NemotronForCausalLM(cfg), (torch.randint(0, vocab, (1, seq)),)


def _module_for(row: dict):
    """(cache key, builder) of the model a user would write for this row; None if no example writes it."""
    label = row["label"]
    if label.startswith("MPT-"):
        size = label.split()[0].split("-")[1]
        h, a, layers = vr.MPT_SHAPES[size]
        return ("mpt", size), lambda: _gpt(h, a, layers, vr.MPT_VOCAB, 2048)
    if label.startswith("GPT3-175B"):
        old = "A100" in label
        # Megatron 2021-22 ran attention unfused with dropout: the model written that way
        kw = {"attention_impl": "math", "dropout": 0.1} if old else {}
        return ("gpt3", old), lambda: _gpt(12288, 96, 96, 51200, 2048, **kw)
    if label.startswith("Nemotron4"):
        # Nemotron-4 as transformers writes it (squared-ReLU MLP, LayerNorm1P, partial RoPE, GQA)
        r = _csv_shapes()[label.split()[0]]
        return ("nemotron", r["model"]), lambda: _nemotron(r)
    if label.startswith("Llama3.1-405B"):
        cfg = llama_example.LlamaConfig(dim=16384, layers=126, heads=128, kv_heads=8, ffn_hidden=53248,
                                        vocab_size=128256, seq_len=8192)
        return ("llama405b",), lambda: (llama_example.Llama(cfg), llama_example.example_inputs(1, cfg))
    return None


def run_engine(layout: Layout, row: dict) -> Engine:
    """The engine the published run used, as the validation script states it (engine flags):
    Megatron-LM / NeMo rows `--engine megatron`, MosaicML's and torchtitan's `--engine pytorch`."""
    source = row.get("source", "")
    name = "megatron" if ("NeMo" in source or "Megatron" in source) else "pytorch"
    # what `autopar plan --engine NAME --tp-comm-overlap --main-grads ... ` builds
    return engine_from_options(name, tp_comm_overlap=layout.tp_comm_overlap or None, main_grads=layout.main_grads,
                               optimizer_impl=layout.optimizer_impl,
                               attention_kernel=MPT_ATTENTION if row["label"].startswith("MPT-") else None)


def _price(spec, layout: Layout, cluster, engine: Engine, fusions: list[dict] = ()):
    """The CLI's pinned estimate: candidate_layout with the engine, the fused chains the
    engine runs charged as the planner charges them; an unstated checkpoint takes the
    least recomputation that fits (validation_runs._price)."""
    cand = Candidate(pp=layout.pp, dp=layout.dp, tp=layout.tp, micro_batch_size=layout.micro_batch_size,
                     num_micro_batches=layout.num_micro_batches, schedule=layout.schedule,
                     virtual_stages=layout.virtual_stages, sequence_parallel=layout.sequence_parallel)
    spec = with_engine(spec, engine)
    spec = charge_fusions(spec, [f for f in fusions if engine.runs_fused(f["pattern"])], cluster.device_profile)
    built = candidate_layout(cand, precision=layout.precision, zero=layout.zero,
                             checkpoint=layout.checkpoint or "none", root_held=root_held_layers(spec), engine=engine)
    built.checkpoint = layout.checkpoint
    return vr._price(spec, built, cluster)


def run(limit: int | None = None, rows: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """Price `rows` (validation_runs specs; default: all it prices) both ways."""
    specs = rows if rows is not None else [s for s in vr.mpt_rows() + vr.tp_pp_rows() if not s.get("skip")]
    captured, fusions, results, skipped = {}, {}, [], []
    for row in specs[:limit] if limit else specs:
        found = _module_for(row)
        if found is None:
            skipped.append({"run": row["label"], "why": "no example file writes this architecture"})
            continue
        key, build = found
        if key not in captured:
            t0 = time.perf_counter()
            with torch.device("meta"):  # planned without allocating weights, as `autopar plan` does
                module, inputs = build()
            captured[key] = model_spec(module, inputs, precision=row["layout"].precision)
            # the chains the fusion pass finds, as `autopar plan` (fusion on by default) records them
            fusions[key] = plan_fusions(module, captured[key])[0]
            print(f"captured {key} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        seq = row["model"]().seq_len
        spec = model_spec(captured[key], seq_len=seq)
        out = {"run": row["label"], "family": row["family"], "metric": row.get("metric", "tokens_per_s_per_gpu"),
               "published": row["published"]}
        for name, engine in (("autopar", AUTOPAR), ("run_engine", run_engine(row["layout"], row))):
            layout, est = _price(spec, row["layout"], row["cluster"], engine, fusions[key])
            predicted = vr._predicted(est, layout, out["metric"])
            out[name] = {"predicted": predicted, "error": predicted / row["published"] - 1.0, "fits": est.fits,
                         "checkpoint": layout.checkpoint, "engine": engine.name, "mfu": est.mfu}
        results.append(out)
    return results, skipped


def _stats(rows: list[dict], key: str) -> dict:
    if not rows:
        return {"rows": 0}
    errs = [r[key]["error"] for r in rows]
    return {"rows": len(rows), "median_abs_error": statistics.median(abs(e) for e in errs),
            "median_signed_error": statistics.median(errs), "within_10pct": sum(abs(e) <= 0.10 for e in errs)}


def summary(results: list[dict]) -> dict:
    out = {}
    for key in ("autopar", "run_engine"):
        fams = {f: _stats([r for r in results if r["family"] == f], key) for f in ("fsdp", "tp/pp")}
        gap = (fams["fsdp"]["median_signed_error"] - fams["tp/pp"]["median_signed_error"]
               if fams["fsdp"]["rows"] and fams["tp/pp"]["rows"] else None)
        out[key] = {"all": _stats(results, key), **fams, "family_gap_points": None if gap is None else gap * 100}
    return out


def write(results, skipped, out_dir: Path) -> None:
    s = summary(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cli_path_validation.json").write_text(
        json.dumps({"summary": s, "rows": results, "skipped": skipped}, indent=1, sort_keys=True) + "\n")
    lines = ["# The validation set through the CLI's path: captured models, pinned layouts", "",
             "Generated by `python3 benchmarks/cli_path_validation.py` (docstring: what it prices and how). "
             "Published figures: `benchmarks/reference/` (validation data: no constant was set from them).", "",
             "| engine priced | rows | median abs error | signed median | FSDP signed | tp/pp signed | "
             "family gap (points) | within 10% |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for key, title in (("autopar", "autopar's own program (no engine flag)"),
                       ("run_engine", "the run's engine (engine flags)")):
        a, f, t = s[key]["all"], s[key]["fsdp"], s[key]["tp/pp"]
        gap = s[key]["family_gap_points"]
        lines.append(f"| {title} | {a['rows']} | {a['median_abs_error']:.1%} | {a['median_signed_error']:+.1%} | "
                     f"{f.get('median_signed_error', 0):+.1%} | {t.get('median_signed_error', 0):+.1%} | "
                     f"{'' if gap is None else f'{gap:.1f}'} | {a['within_10pct']} |")
    lines += ["", "| run | family | published | autopar engine | error | run's engine | error | engine |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        a, e = r["autopar"], r["run_engine"]
        lines.append(f"| {r['run']} | {r['family']} | {r['published']:.1f} | {a['predicted']:.1f} | "
                     f"{a['error']:+.1%}{'' if a['fits'] else ' (no fit)'} | {e['predicted']:.1f} | "
                     f"{e['error']:+.1%}{'' if e['fits'] else ' (no fit)'} | {e['engine']} |")
    if skipped:
        lines += ["", "Left out:", ""] + [f"- {x['run']}: {x['why']}" for x in skipped]
    (out_dir / "cli_path_validation.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--limit", type=int, default=None, help="price only the first N rows")
    args = ap.parse_args()
    results, skipped = run(args.limit)
    write(results, skipped, Path(args.out))
    s = summary(results)
    for key in ("autopar", "run_engine"):
        a = s[key]["all"]
        print(f"{key:10s}: {a['rows']} rows, median |error| {a['median_abs_error']:.1%}, signed "
              f"{a['median_signed_error']:+.1%}, FSDP {s[key]['fsdp'].get('median_signed_error', 0):+.1%}, "
              f"tp/pp {s[key]['tp/pp'].get('median_signed_error', 0):+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
