import os
import socket
import sys
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
