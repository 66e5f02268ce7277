"""The validation set's rules (issue 35, item 2): a set that can fail.

benchmarks/validation_runs.py prices every published run it can read; this
module decides which of them form the validation set and what the set must
hold, so that no single source steers the verdict:

- at least MIN_SOURCES independent sources (a source is the repository or
  document a row was read from, not the table inside it);
- no source more than a third of the rows: a source over the cap keeps rows
  at a fixed stride through its file order (`select`), so the subsample is
  the same on every run and was not chosen by looking at errors;
- results per source, per scale band (<= 64, 65-512, > 512 GPUs) and per
  family (fsdp = ZeRO-3 / FSDP without tp or pp; zero = data parallel with
  ZeRO 0-2; tp/pp = tensor or pipeline parallel > 1);
- each band's median |error| stays within BAND_BOUNDS, written down from the
  set's first pricing with all its sources (the date and commit are in
  benchmarks/reference/validation_history.md, which records every move since).
  No cost constant was tuned to these rows; the bounds guard against a change
  that moves the set, they do not certify it.

Rows that set or checked a constant elsewhere (the calibration tables named in
CALIBRATION_FILES) are listed apart and never counted.
"""
from __future__ import annotations

import csv
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "benchmarks" / "reference"
MORE_CSV = REFERENCE / "validation_more_runs.csv"
HISTORY = REFERENCE / "validation_history.md"

MIN_SOURCES = 6
MAX_SOURCE_SHARE = 1 / 3
BANDS = (("<= 64 GPUs", 1, 64), ("65-512 GPUs", 65, 512), ("> 512 GPUs", 513, 10**9))
FAMILIES = ("fsdp", "zero", "tp/pp")
# Bound on each band's median |error|: where the band was first priced with all seven sources
# (2026-11-28, commit c23ed3d: 6.5%, 10.0%, 4.1%) plus 3 points, never above issue 35's 12%. A band
# that moves 3 points from where it was first seen fails, whichever way the change was meant
# (validation_history.md says why the first bounds, 12% each, were tightened to these).
BAND_BOUNDS = {"<= 64 GPUs": 0.095, "65-512 GPUs": 0.12, "> 512 GPUs": 0.071}
MEDIAN_BOUND = 0.10  # issue 35's acceptance, over the whole set
FAMILY_GAP_BOUND = 0.05  # signed medians of the fsdp and tp/pp families, at most 5 points apart

# Tables used to set or check a cost constant elsewhere (benchmarks/reference/README.md):
# they never enter the set, and the set's report lists them apart.
CALIBRATION_FILES = {
    "published_runs.csv": "calibration set of benchmarks/published_runs.py (constants set while looking at it)",
    "megatron_sc21_table1.csv": "Megatron SC'21 Table 1, checked by benchmarks/megatron_weak_scaling.py",
    "korthikanti_table4_layer_times.csv": "per-layer times, the layer cost model's unit check",
}


def source_of(spec: dict) -> str:
    """The independent source a priced row was read from (repository or document)."""
    src = spec["source"]
    if src.startswith("llm-foundry"):
        return "mosaicml/llm-foundry"
    if src.startswith("dgxc-benchmarking"):
        return "NVIDIA/dgxc-benchmarking"
    if src.startswith("Megatron-LM"):
        return "NVIDIA/Megatron-LM"
    if src.startswith("NeMo Megatron"):
        return "NVIDIA/NeMo-Megatron-Launcher"
    if src.startswith("torchtitan"):
        return "pytorch/torchtitan"
    return src


def family_of(layout) -> str:
    if layout.tp > 1 or layout.pp > 1:
        return "tp/pp"
    return "fsdp" if layout.zero == 3 else "zero"


def band_of(gpus: int) -> str:
    return next(name for name, lo, hi in BANDS if lo <= gpus <= hi)


def _cap(sizes: dict[str, int]) -> int:
    """The largest per-source row count k with k <= (sum of min(n, k)) / 3."""
    best = 0
    for k in range(1, max(sizes.values()) + 1):
        if 3 * k <= sum(min(n, k) for n in sizes.values()):
            best = k
    return best


def select(specs: list[dict]) -> tuple[list[dict], dict[str, tuple[int, int]]]:
    """The set: every priceable spec, sources over a third thinned at a fixed stride.

    Returns the kept specs (file order) and, per source, (rows kept, rows available)."""
    by_source: dict[str, list[dict]] = {}
    for spec in specs:
        by_source.setdefault(source_of(spec), []).append(spec)
    cap = _cap({s: len(v) for s, v in by_source.items()})
    kept, counts = [], {}
    for source, rows in by_source.items():
        if len(rows) > cap:
            # evenly spaced through the file's order: index floor(i * n / cap)
            rows = [rows[i * len(rows) // cap] for i in range(cap)]
        kept += rows
        counts[source] = (len(rows), len(by_source[source]))
    return kept, counts


def _median_abs(rows):
    return statistics.median(abs(r["error"]) for r in rows)


def summarize(rows: list[dict], key: str) -> dict[str, dict]:
    out = {}
    for value in sorted({r[key] for r in rows}):
        group = [r for r in rows if r[key] == value]
        out[value] = {"rows": len(group), "median_abs": _median_abs(group),
                      "signed_median": statistics.median(r["error"] for r in group),
                      "within_10": sum(abs(r["error"]) <= 0.10 for r in group)}
    return out


def calibration_keys() -> set[tuple[str, int, str]]:
    """(model, GPUs, device family) of every calibration row that names its model."""
    keys = set()
    for name in CALIBRATION_FILES:
        with open(REFERENCE / name) as f:
            for row in csv.DictReader(f):
                if row.get("model") and (row.get("gpus") or "").isdigit():
                    keys.add((row["model"], int(row["gpus"]), (row.get("hardware") or row.get("gpu") or "")[:4].upper()))
    return keys


def _key(row: dict) -> tuple[str, int, str]:
    """A priced row's (model, GPUs, device family), read from its label ('<model> ... <gpus>x <device> ...')."""
    words = row["run"].split()
    at = next(i for i, w in enumerate(words) if w.endswith("x") and w[:-1].isdigit())
    return words[0], row["gpus"], words[at + 1][:4].upper()


def check(rows: list[dict]) -> list[str]:
    """What the set breaks of its own rules (empty: it holds)."""
    calibration = calibration_keys()
    problems = [f"{r['run']}: a calibration row" for r in rows if _key(r) in calibration]
    sources = summarize(rows, "set_source")
    if len(sources) < MIN_SOURCES:
        problems.append(f"{len(sources)} sources, at least {MIN_SOURCES} required")
    for source, st in sources.items():
        if st["rows"] > MAX_SOURCE_SHARE * len(rows):
            problems.append(f"{source}: {st['rows']} of {len(rows)} rows, more than a third")
    bands = summarize(rows, "band")
    for band, bound in BAND_BOUNDS.items():
        if band not in bands:
            problems.append(f"band {band}: no rows")
        elif bands[band]["median_abs"] > bound:
            problems.append(f"band {band}: median |error| {bands[band]['median_abs']:.1%} above its bound {bound:.1%}")
    overall = _median_abs(rows)
    if overall > MEDIAN_BOUND:
        problems.append(f"median |error| {overall:.1%} above {MEDIAN_BOUND:.0%}")
    fams = summarize(rows, "set_family")
    if "fsdp" in fams and "tp/pp" in fams:
        gap = abs(fams["fsdp"]["signed_median"] - fams["tp/pp"]["signed_median"])
        if gap > FAMILY_GAP_BOUND:
            problems.append(f"fsdp and tp/pp signed medians {gap * 100:.1f} points apart (bound "
                            f"{FAMILY_GAP_BOUND * 100:.0f})")
    else:
        problems.append("the set lacks the fsdp or the tp/pp family")
    return problems


def calibration_rows() -> list[str]:
    """One line per calibration row (listed apart, never counted)."""
    lines = []
    for name, role in CALIBRATION_FILES.items():
        with open(REFERENCE / name) as f:
            rows = list(csv.DictReader(f))
        for row in rows:
            what = row.get("model") or f"GPT {row.get('params_B', '?')}B"
            gpus = row.get("gpus") or "?"
            lines.append(f"{name}: {row.get('system', '')} {what} on {gpus} GPUs ({role})".replace("  ", " "))
    return lines


def _table(title: str, stats: dict[str, dict], extra: dict[str, str] | None = None, extra_head: str = "") -> list[str]:
    head = f"| {title} | rows | median abs error | signed median | within 10% |" + (f" {extra_head} |" if extra else "")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for name, st in stats.items():
        cell = f" {extra.get(name, '')} |" if extra else ""
        lines.append(f"| {name} | {st['rows']} | {st['median_abs']:.1%} | {st['signed_median']:+.1%} | "
                     f"{st['within_10']} |{cell}")
    return lines


def render(rows: list[dict], counts: dict[str, tuple[int, int]]) -> list[str]:
    """The set's part of benchmarks/results/validation_runs.md."""
    problems = check(rows)
    overall = {"all": summarize([{**r, "all": "all"} for r in rows], "all")["all"]}
    bands = summarize(rows, "band")
    fams = summarize(rows, "set_family")
    lines = [
        "## The validation set (issue 35): rules, then results",
        "",
        f"Rules (benchmarks/validation_set.py, checked by tests/test_cost_validation_set.py): at least {MIN_SOURCES}",
        "independent sources; no source more than a third of the rows (a source over the cap keeps rows at a fixed",
        "stride through its file order, chosen before any error was seen); every scale band's median |error| within",
        f"its bound; the whole set's median within {MEDIAN_BOUND:.0%}; the fsdp and tp/pp families' signed medians",
        f"within {FAMILY_GAP_BOUND * 100:.0f} points. Bounds written down at the first pricing (history below);",
        "no cost constant was tuned to these rows.",
        "",
        f"**Verdict: {'holds' if not problems else 'FAILS: ' + '; '.join(problems)}.**",
        "",
    ]
    lines += _table("set", overall) + [""]
    lines += _table("source", summarize(rows, "set_source"),
                    {s: f"{k} of {n}" for s, (k, n) in counts.items()}, "kept of priceable") + [""]
    lines += _table("scale band", {b: bands[b] for b, _, _ in BANDS if b in bands},
                    {b: f"{v:.1%}" for b, v in BAND_BOUNDS.items()}, "bound") + [""]
    lines += _table("family", {f: fams[f] for f in FAMILIES if f in fams}) + [""]
    missing = [f for f in FAMILIES if f not in fams]
    if missing:
        lines += [f"No row of the set is in family {', '.join(missing)} (the stride kept none of llm-foundry's "
                  "SHARD_GRAD_OP rows and no other source publishes a ZeRO-1/2-only run on a modelled device).", ""]
    lines += ["| run | source | band | family | published | predicted | error | fits |", "|---|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['set_source']} | {r['band']} | {r['set_family']} | {r['published']:.1f} | "
                     f"{r['predicted']:.1f} | {r['error']:+.1%} | {'yes' if r['fits'] else 'NO'} |")
    lines += ["", "Calibration rows (set or checked a constant elsewhere; listed apart, never counted):", ""]
    lines += [f"- {line}" for line in calibration_rows()]
    lines += ["", HISTORY.read_text().rstrip(), ""]
    return lines
