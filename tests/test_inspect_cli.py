"""`autopar inspect`: the layer table and its JSON form."""
import json

import pytest

from autopar.cli import main


def test_inspect_json_has_public_names(capsys):
    assert main(["inspect", "examples/gpt.py:gpt_tiny", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data)[0:2] == ["name", "total_params"]
    assert data["total_params"] == 55488 and data["name"] == "gpt_tiny"
    names = [row["name"] for row in data["layers"]]
    assert names == ["embedding", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    for row in data["layers"]:
        assert {"name", "kind", "params", "param_bytes", "fwd_flops", "bwd_flops", "activation_bytes",
                "output_bytes"} <= set(row)


def test_inspect_batch_size_scales_per_sample_numbers(capsys):
    main(["inspect", "examples/llama.py:llama_tiny", "--json"])
    one = json.loads(capsys.readouterr().out)
    main(["inspect", "examples/llama.py:llama_tiny", "--json", "--batch-size", "8"])
    eight = json.loads(capsys.readouterr().out)
    assert eight["batch_size"] == 8
    for a, b in zip(one["layers"], eight["layers"]):
        assert b["fwd_flops"] == 8 * a["fwd_flops"] and b["params"] == a["params"]


def test_inspect_table(capsys):
    assert main(["inspect", "examples/resnet.py:resnet_tiny", "--ops"]) == 0
    out = capsys.readouterr().out
    for text in ("resnet_tiny", "stem", "layer1.0", "conv_stage", "head", "total", "fwd GFLOPs", "act MB",
                 "total params 135,506", "conv1:convolution"):
        assert text in out


@pytest.mark.parametrize("args,message", [
    (["inspect", "examples/missing.py"], "model file not found"),
    (["inspect", "examples/gpt.py:nope"], "has no function nope()"),
    (["inspect", "examples/gpt.py:gpt_tiny", "--batch-size", "0"], "--batch-size must be a positive integer"),
])
def test_inspect_errors_exit_2_without_traceback(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_inspect_model_file_without_example_inputs(tmp_path, capsys):
    path = tmp_path / "m.py"
    path.write_text("import torch\ndef build_model(): return torch.nn.Linear(4, 4)\n")
    assert main(["inspect", str(path)]) == 2
    assert "defines no example_inputs" in capsys.readouterr().err


def test_inspect_loss_flag_adds_the_loss_to_the_head(capsys):
    main(["inspect", "examples/gpt.py:gpt_tiny", "--json"])
    plain = json.loads(capsys.readouterr().out)
    assert main(["inspect", "examples/gpt.py:gpt_tiny", "--json", "--loss"]) == 0
    with_loss = json.loads(capsys.readouterr().out)
    assert with_loss["layers"][-1]["attrs"]["loss"] is True
    assert with_loss["layers"][-1]["activation_bytes"] > plain["layers"][-1]["activation_bytes"]


def test_inspect_infers_inputs_and_keeps_stdout_json(capsys):
    """nanoGPT prints its parameter count while it builds: stdout stays JSON."""
    assert main(["inspect", "examples/nanogpt.py:nanogpt_tiny", "--json", "--seq-len", "32"]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    assert "number of parameters" in out.err
    assert data["seq_len"] == 32
    assert data["notes"][0].startswith("example inputs inferred: idx (batch, 32)") and "from --seq-len" in data["notes"][0]


def test_inspect_seq_len_evaluates_a_files_own_inputs_at_that_length(capsys):
    main(["inspect", "examples/gpt.py:gpt_tiny", "--json"])
    traced = json.loads(capsys.readouterr().out)
    assert main(["inspect", "examples/gpt.py:gpt_tiny", "--json", "--seq-len", "8"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert short["seq_len"] == 8 and traced["seq_len"] != 8
    assert any("evaluated at --seq-len 8" in note for note in short["notes"])
    import sympy
    expr = sympy.sympify(traced["layers"][1]["expressions"]["fwd_flops"])
    assert short["layers"][1]["fwd_flops"] == int(expr.subs({"b": 1, "s": 8}))


@pytest.mark.parametrize("args,message", [
    (["inspect", "examples/vit.py:vit_tiny", "--seq-len", "16"], "has no sequence axis"),
    (["inspect", "examples/nanogpt.py:nanogpt_tiny", "--seq-len", "128"], "learned position table transformer.wpe (64"),
    (["inspect", "examples/gpt.py:gpt_tiny", "--seq-len", "0"], "--seq-len must be a positive integer"),
])
def test_inspect_bad_seq_len_exits_2(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_inspect_loss_flag_with_inferred_targets_is_the_models_own_loss(capsys):
    main(["inspect", "examples/nanogpt.py:nanogpt_tiny", "--json"])
    plain = json.loads(capsys.readouterr().out)
    assert main(["inspect", "examples/nanogpt.py:nanogpt_tiny", "--json", "--loss"]) == 0
    with_loss = json.loads(capsys.readouterr().out)
    assert with_loss["layers"][-1]["activation_bytes"] == plain["layers"][-1]["activation_bytes"]  # not twice
    assert any(op["name"].endswith("_log_softmax") for op in plain["layers"][-1]["ops"])


def test_inspect_failure_on_inferred_inputs_says_what_was_assumed(tmp_path, capsys):
    path = tmp_path / "fixed.py"
    path.write_text("import sys\nsys.path.insert(0, %r)\nfrom test_capture_models import FixedPositions\n"
                    "def build_model(): return FixedPositions()\n" % str(__import__("pathlib").Path(__file__).parent))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "module <root>" in err and "Traceback" not in err
    assert "Example inputs inferred: tokens (batch, 2048)" in err and "define example_inputs" in err
    assert main(["inspect", str(path), "--seq-len", "16"]) == 0  # the length it was built for
