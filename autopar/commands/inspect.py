"""`autopar inspect model.py[:factory]`: the captured layer table.

Numbers are for one micro-batch of --batch-size samples (default 1, i.e. per
sample) at the model's sequence length (or --seq-len); --json prints
ModelGraph.to_dict() (public names, `total_params` on top, symbolic
expressions included). A model file without example_inputs gets inferred ones
(autopar/capture/auto_inputs.py); what was assumed is printed as a note.
"""
from __future__ import annotations

import argparse
import sys

from autopar.errors import AutoparError
from autopar.plan import PRECISIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model file following the model-file convention, as path.py[:factory]")
    parser.add_argument("--batch-size", type=int, default=1, metavar="N",
                        help="samples per micro-batch the numbers are for (default 1: per sample)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="S",
                        help="sequence length the numbers are for (default: the example inputs'; inferred "
                             "inputs use min(max positions, 2048))")
    parser.add_argument("--precision", default="bf16", choices=PRECISIONS, help="training compute dtype")
    parser.add_argument("--json", action="store_true", help="print the layer table as JSON")
    parser.add_argument("--loss", action="store_true",
                        help="include the model file's loss_fn(output, targets) in the head layer")
    parser.add_argument("--ops", action="store_true", help="also list each layer's ops (table output only)")


def run(args) -> int:
    import copy

    from autopar.commands.common import capture_loaded, check_seq_len
    from autopar.model_file import load_model

    if args.batch_size < 1:
        raise AutoparError(f"--batch-size must be a positive integer, got {args.batch_size}")
    if args.seq_len is not None and args.seq_len < 1:
        raise AutoparError(f"--seq-len must be a positive integer, got {args.seq_len}")
    loaded = load_model(args.model, device="meta", seq_len=args.seq_len)
    own_loss = getattr(loaded.example_inputs, "computes_loss", False)  # inferred labels: forward returns the loss
    if args.loss and loaded.loss_fn is None and not own_loss:
        raise AutoparError(f"{args.model} defines no loss_fn(output, targets)",
                           hint="add one to the model file or drop --loss")
    graph = capture_loaded(loaded, dtype=args.precision,
                           loss_fn=loaded.loss_fn if args.loss and not own_loss else None)
    check_seq_len(graph, loaded.model, args.seq_len)
    if loaded.inputs_note:
        graph.notes.insert(0, loaded.inputs_note)
    if args.seq_len is not None and args.seq_len != graph.seq_len:
        # The expressions are exact polynomials in S: a new length is a new value, not a re-trace.
        graph.notes.append(f"traced at seq {graph.seq_len}, evaluated at --seq-len {args.seq_len}")
        graph = copy.copy(graph)
        graph.seq_len = graph.tokens_per_sample = args.seq_len
    data = graph.to_dict(args.batch_size)
    if args.json:
        print(graph.to_json(args.batch_size))
    else:
        print_table(data, show_ops=args.ops)
    return 0


def _num(value: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:,.2f}{unit}"
    return f"{value:,.0f}"


def print_table(data: dict, show_ops: bool = False, file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file or sys.stdout, width=max(120, Console().width))
    per = "sample" if data["batch_size"] == 1 else f"micro-batch of {data['batch_size']}"
    seq = f", seq {data['seq_len']}" if data["seq_len"] else ""
    table = Table(title=f"{data['name']}: {len(data['layers'])} layers, per {per}{seq}, {data['dtype']}",
                  title_justify="left")
    for col, justify in (("#", "right"), ("name", "left"), ("kind", "left"), ("params", "right"),
                         ("fwd GFLOPs", "right"), ("bwd GFLOPs", "right"), ("act MB", "right"),
                         ("out MB", "right"), ("TP", "left")):
        table.add_column(col, justify=justify)
    for i, row in enumerate(data["layers"]):
        tp = row["tp_degrees"]
        table.add_row(str(i), row["name"], row["kind"], _num(row["params"]),
                      f"{row['fwd_flops'] / 1e9:,.3f}", f"{row['bwd_flops'] / 1e9:,.3f}",
                      f"{row['activation_bytes'] / 1e6:,.3f}", f"{row['output_bytes'] / 1e6:,.3f}",
                      f"<= {max(tp)}" if len(tp) > 1 else "-")
        if show_ops:
            for op in row["ops"]:
                table.add_row("", f"  {op['name']}", op["kind"], "", f"{op['fwd_flops'] / 1e9:,.3f}",
                              f"{op['bwd_flops'] / 1e9:,.3f}", "", "", "tp" if op["tp_sharded"] else "")
    t = data["totals"]
    table.add_section()
    table.add_row("", "total", "", _num(data["total_params"]), f"{t['fwd_flops'] / 1e9:,.3f}",
                  f"{t['bwd_flops'] / 1e9:,.3f}", f"{t['activation_bytes'] / 1e6:,.3f}", "", "")
    console.print(table)
    console.print(f"total params {data['total_params']:,} ({data['total_param_bytes'] / 2**30:,.2f} GiB at "
                  f"{data['dtype']}); graph {data['graph']['nodes']} ops; training FLOPs per {per}: "
                  f"{_num(t['fwd_flops'] + t['bwd_flops'])}FLOP")
    for note in data["notes"]:
        console.print(f"note: {note}")
