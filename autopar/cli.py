"""`autopar` command line: a thin dispatcher.

Each subcommand lives in `autopar/commands/<name>.py` with
`add_arguments(parser)` and `run(args) -> int`; it is imported only when used,
so `autopar inspect` never pays for the solver's imports. User errors
(AutoparError) print as one clear message and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from autopar.errors import AutoparError
from cost_models.errors import CostModelError

COMMANDS = {
    "inspect": "print the captured layer table of a model file",
    "plan": "search for the best parallel layout and print the plan",
    "report": "write a self-contained HTML report of a plan",
    "compile": "emit a runnable build/ (train.py, plan.json, launch scripts)",
}


def _command_module(name: str):
    return importlib.import_module(f"autopar.commands.{name.replace('-', '_')}")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Auto-parallelizer for PyTorch training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen command's module is imported (keeps `--help` and inspect fast).
    chosen = next((a for a in (argv or []) if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            _command_module(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        return int(_command_module(args.command).run(args) or 0)
    except AutoparError as exc:
        print(f"autopar {args.command}: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except CostModelError as exc:  # bad profile / cluster file / layout: the message names field and file
        print(f"autopar {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
