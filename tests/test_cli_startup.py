"""`autopar --help` and argument errors answer before the heavy stack loads.

torch, sympy, networkx, ortools, transformers and jinja2 take seconds to
import; a user who mistypes a flag should not wait for them. Each check runs
in a fresh interpreter and looks at sys.modules (no timing assertions: the
machine running the tests may be busy).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "sympy", "networkx", "ortools", "transformers", "jinja2", "numpy")


def loaded_after(code: str) -> list[str]:
    """The HEAVY modules present in sys.modules after running `code` in a fresh interpreter."""
    probe = code + f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["plan", "--help"], ["report", "--help"], ["compile", "--help"],
                                  ["inspect", "--help"], ["plan", "--bogus-flag"], ["plan"],
                                  ["plan", "m.py", "--precision", "fp8"]])
def test_help_and_argument_errors_import_no_heavy_module(argv):
    code = ("import sys\nfrom autopar.cli import main\n"
            f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n")
    assert loaded_after(code) == []


@pytest.mark.parametrize("flags", [["--gpus", "16", "--tp", "3"], ["--gpus", "12"], ["--schedule", "zigzag"],
                                   ["--batch-size", "0"]])
def test_flag_errors_are_answered_before_the_heavy_stack_loads(flags):
    # refused before the model file is imported or the solver loaded (docs/cli.md: "in the first second")
    code = ("from autopar.cli import main\n"
            f"assert main(['plan', 'examples/gpt.py:gpt_tiny', *{flags!r}]) == 2\n")
    assert loaded_after(code) == []


def test_import_autopar_cli_and_build_the_parser_imports_no_heavy_module():
    code = "from autopar.cli import build_parser\nfor c in ('plan', 'report', 'compile', 'inspect'): build_parser([c])"
    assert loaded_after(code) == []


def test_the_public_names_still_load_on_first_use():
    code = ("import autopar\nassert callable(autopar.capture) and autopar.ModelGraph.__name__ == 'ModelGraph'\n"
            "assert autopar.ClusterSpec.__name__ == 'ClusterSpec' and callable(autopar.compile)\n"
            "import autopar.capture.api\nassert callable(autopar.capture)  # the subpackage is the function too\n"
            "from autopar import capture\nassert callable(capture)\n"
            "from cost_models import Layout, layer_cost, B\nassert callable(layer_cost)\n")
    assert "torch" in loaded_after(code)


def test_read_only_commands_end_at_once_with_their_output_whole():
    """`autopar plan` run as the process ends with os._exit once its output is flushed
    (cli._EXIT_AT_ONCE: Python's teardown of torch took 1.6 s of a 14 s plan): the JSON
    on stdout is whole, the exit status is the command's, and a refusal still exits 2;
    main(argv) called from Python (these tests) returns as before."""
    plan = subprocess.run([sys.executable, "-m", "autopar", "plan", "examples/gpt.py:gpt_tiny", "--gpus", "2",
                           "--device", "cpu", "--batch-size", "4", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert json.loads(plan.stdout)["mesh"]["dp"] * json.loads(plan.stdout)["mesh"]["tp"] >= 1
    refused = subprocess.run([sys.executable, "-m", "autopar", "plan", "examples/gpt.py:gpt_tiny", "--gpus", "2",
                              "--device", "cpu", "--batch-size", "4", "--tp", "2", "--pp", "2"],
                             capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert refused.returncode == 2 and "autopar plan" in refused.stderr
    from autopar.cli import main
    assert main(["plan", "examples/gpt.py:gpt_tiny", "--gpus", "2", "--device", "cpu", "--batch-size", "4",
                 "--tp", "2", "--pp", "2"]) == 2  # still here: main(argv) returns
