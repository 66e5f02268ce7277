import os
import socket
import sys
from pathlib import Path

import pytest

# Triton kernels can only run on CPU through the interpreter; it must be set
# before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# Reference figures the tests check against; each file's source is in the
# README beside it. Nothing outside the checkout is read.
REFERENCE = ROOT / "benchmarks" / "reference"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))


@pytest.fixture(scope="module")
def tiny():
    """examples/gpt.py's gpt_tiny: (model, example inputs), for hand plans (`hand_plan`)."""
    from gpt import gpt_tiny
    return gpt_tiny()


def hand_plan(tiny, **layout):
    """plan_for_model on the `tiny` fixture's model with the layout given."""
    from autopar.lower.manual_plan import plan_for_model
    model, example = tiny
    return plan_for_model(model, example_inputs=example, name="gpt_tiny", **layout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def benchmark_rows(script: str, cases: list[str], out: Path, timeout: int = 1500) -> list[dict]:
    """`python3 benchmarks/<script> --cases ... --out out`: its rows, in the cases' order
    (the benchmark's stderr shown when it fails)."""
    import json
    import subprocess

    proc = subprocess.run([sys.executable, f"benchmarks/{script}", "--cases", ",".join(cases), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(Path(f"{out}.json").read_text())["rows"]
    assert list(dict.fromkeys(r["case"] for r in rows)) == cases
    return rows
