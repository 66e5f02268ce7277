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
