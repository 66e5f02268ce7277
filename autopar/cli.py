"""`autopar` command line: a thin dispatcher.

Each subcommand lives in `autopar/commands/<name>.py` with
`add_arguments(parser)` and `run(args) -> int`; it is imported only when used,
so `autopar inspect` never pays for the solver's imports.

Exit codes: 0 success, 2 bad input (AutoparError, a cost-model input error,
argparse usage errors), 1 an internal error (a bug in autopar: one line that
says so and where; AUTOPAR_DEBUG=1 prints the traceback), 130 interrupted.
A user never sees a traceback for a mistake of theirs.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from autopar.errors import AutoparError
from cost_models.errors import CostModelError

COMMANDS = {
    "inspect": "print the captured layer table of a model file",
    "plan": "search for the best parallel layout and print the plan",
    "report": "write a self-contained HTML report of a plan",
    "compile": "emit a runnable build/ (train.py, plan.json, launch scripts)",
    "calibrate": "time this machine and write a measured profile for --profile",
    "export": "write a training snapshot's model as one safetensors file",
    "export-config": "write a plan as a DeepSpeed / torchtitan / Megatron / accelerate / HF config",
}

EPILOG = """examples:
  autopar inspect examples/llama.py:llama3_8b
  autopar plan examples/gpt.py:gpt3_175b --gpus 1024 --device a100-80g --batch-size 1536
  autopar plan examples/gpt.py:gpt3_175b --gpus 1024 --device a100-80g --json > plan.json
  autopar report --plan plan.json -o plan.html
  autopar compile examples/gpt.py:gpt_tiny --gpus 4 --device cpu -o build/
  autopar calibrate --device cpu --ranks 2 -o cpu.json
  autopar plan examples/gpt.py:gpt_tiny --gpus 2 --device cpu --profile cpu.json
  autopar export ckpt/ -o model.safetensors
  autopar export-config plan.json --to deepspeed -o ds_config.json

`autopar COMMAND --help` lists each command's options."""


def _command_module(name: str):
    return importlib.import_module(f"autopar.commands.{name.replace('-', '_')}")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Auto-parallelizer for PyTorch training.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen command's module is imported (keeps `--help` and inspect fast).
    chosen = next((a for a in (argv or []) if a in COMMANDS), None)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            _command_module(name).add_arguments(p)
    return parser


def _print_error(command: str, message: str, hint: str | None = None) -> None:
    print(f"autopar {command}: error: {message}", file=sys.stderr)
    if hint:
        print(f"  hint: {hint}", file=sys.stderr)


def _internal_error(command: str, exc: BaseException) -> int:
    """An exception autopar did not expect is a bug in autopar, not the user's input:
    say so in one line with where it happened, keep the traceback for AUTOPAR_DEBUG=1."""
    if os.environ.get("AUTOPAR_DEBUG"):
        traceback.print_exception(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {os.path.relpath(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    _print_error(command, f"internal error: {type(exc).__name__}: {exc}{where}",
                 "this is a bug in autopar, not in your input; rerun with AUTOPAR_DEBUG=1 for the traceback "
                 "and report it with the command line")
    return 1


# Commands that only read and print: run as the process itself (the console script), they
# end with os._exit once their output is flushed. Python's teardown of torch and of the
# planner's tables and memos took 1.6 s of a 14 s `autopar plan` of GPT-3 175B, and nothing
# of these commands needs an atexit handler (their files are closed when `run` returns).
_EXIT_AT_ONCE = ("plan", "report", "inspect")


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if argv is None and (sys.argv[1:2] or [None])[0] in _EXIT_AT_ONCE:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError, OSError):  # the reader left, or the stream is closed
            pass
    os._exit(code)


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        if hasattr(args, "model_size"):  # plan, report, compile: a model file or --model-size
            from autopar.commands.common import apply_model_size
            apply_model_size(args)
        return int(_command_module(args.command).run(args) or 0)
    except AutoparError as exc:
        from autopar.commands.advice import infeasible_advice

        hint = infeasible_advice(exc, cluster_file=getattr(args, "cluster", None)) or exc.hint
        _print_error(args.command, exc.message, hint)
        return exc.exit_code
    except CostModelError as exc:  # bad profile / cluster file / layout: the message names field and file
        from autopar.commands.common import cluster_error

        err = cluster_error(exc) if getattr(exc, "field", None) or getattr(exc, "file", None) else None
        _print_error(args.command, err.message if err else str(exc), err.hint if err else None)
        return 2
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `autopar plan ... --json | head`: the reader left, nothing to report
        # Python's recipe: point stdout at devnull so the flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as exc:  # noqa: BLE001 - last line of defence: a bug gets one line, not a traceback
        return _internal_error(args.command, exc)


if __name__ == "__main__":
    sys.exit(main())
