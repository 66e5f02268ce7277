"""Every mistake a new user makes ends in one clear message, exit code 2, no traceback.

Runs `autopar.cli.main(argv)` in-process (the console script is a one-line
wrapper around it) on model files, cluster files and plan files written the
way people get them wrong. Each case asserts the exit code, that no traceback
was printed, and that the message names what is wrong (the file, the field,
the module and op) and says what to do.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.commands.advice import infeasible_advice
from autopar.errors import InfeasibleError

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")

MODEL_FILE = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, d=256, n=4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # branches on a tensor value: no value exists on meta
            return x
        return -x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.proj(x))


def build_model():
    return Net()


def example_inputs(batch_size):
    return (torch.randn(batch_size, 256),)


def broken_config():
    raise RuntimeError("config.json has no field n_layer")


def returns_config():
    return {"n_layer": 2}


def untraceable():
    return Gated(), (lambda b: (torch.randn(b, 8),))
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_errors")

    def write(name, text):
        path = d / name
        path.write_text(textwrap.dedent(text))
        return str(path)

    paths = {
        "model": write("net.py", MODEL_FILE),
        "syntax": write("typo.py", "import torch\ndef build_model(:\n    pass\n"),
        "yaml": write("bad.yaml", "device: a100-80g\ngpus_per_node: 8\n  nodes: [2\n"),
        "missing": write("missing.yaml", "gpus_per_node: 8\nnodes: 2\n"),
        "negative": write("negative.yaml", """\
            cluster: {nodes: 2, gpus_per_node: 8, device: a100-80g, intra_node_link: fast, inter_node_link: ib-hdr}
            links:
              fast: {bandwidth_gbs: -300, latency_us: 3}
            """),
        "unknown_device": write("unknown.yaml", "device: a100-1000g\ngpus_per_node: 8\nnodes: 2\n"),
        # A device with 2 MB and a host with 1 MB: nothing fits, quickly.
        "oom": write("oom.yaml", """\
            cluster: {nodes: 1, gpus_per_node: 2, device: tiny, intra_node_link: nvlink3,
                      inter_node_link: ib-hdr, host_memory_gib: 0.001}
            devices:
              tiny: {peak_tflops: {bf16: 100}, memory_gib: 0.002, reserve_gib: 0.0005, memory_bandwidth_tbs: 1}
            """),
        "dir": str(d),
    }
    return paths


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


def assert_user_error(capsys, argv, *needles):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, err
    # a slow capture may be announced first (a progress line after 3 s, docs/cli.md)
    err = re.sub(rf"^(autopar {argv[0]}: [^\n]* \(\d+ s\)\n)+", "", err)
    assert err.startswith(f"autopar {argv[0]}: error: "), err
    for needle in needles:
        assert needle in err, f"{needle!r} not in:\n{err}"
    return err


# -- model files ------------------------------------------------------------------------------
def test_missing_model_file(capsys, files):
    assert_user_error(capsys, ["inspect", files["dir"] + "/nope.py"], "model file not found", "nope.py",
                      "build_model()")


def test_missing_factory_lists_the_ones_there(capsys, files):
    assert_user_error(capsys, ["inspect", files["model"] + ":gpt_huge"], "has no function gpt_huge()",
                      "untraceable", "broken_config")


def test_factory_that_raises_names_it_and_the_exception(capsys, files):
    assert_user_error(capsys, ["inspect", files["model"] + ":broken_config"], "broken_config() raised RuntimeError",
                      "config.json has no field n_layer")


def test_factory_returning_a_non_module(capsys, files):
    assert_user_error(capsys, ["plan", files["model"] + ":returns_config"], "returned dict, not an nn.Module")


def test_model_file_that_does_not_import(capsys, files):
    assert_user_error(capsys, ["inspect", files["syntax"]], "importing", "typo.py", "SyntaxError")


def test_untraceable_model_names_the_module_and_the_op(capsys, files):
    err = assert_user_error(capsys, ["inspect", files["model"] + ":untraceable"], "gate",
                            "data-dependent control flow", "if x.sum() > 0")
    assert "hint:" in err  # says how to fix it (torch.where, masking)


# -- cluster files and GPU counts -----------------------------------------------------------------
@pytest.mark.parametrize("key, needles", [
    ("yaml", ["bad.yaml", "not valid YAML", "line 3"]),
    ("missing", ["missing.yaml", "cluster.device", "missing"]),
    ("negative", ["negative.yaml", "links.fast.bandwidth_gbs", "-300"]),
    ("unknown_device", ["unknown.yaml", "unknown device 'a100-1000g'", "h100-sxm"]),
])
def test_malformed_cluster_file_names_the_file_and_the_field(capsys, files, key, needles):
    assert_user_error(capsys, ["plan", GPT + ":gpt_tiny", "--cluster", files[key]], *needles)


def test_cluster_file_that_does_not_exist(capsys, files):
    assert_user_error(capsys, ["plan", GPT + ":gpt_tiny", "--cluster", files["dir"] + "/cluster.yaml"],
                      "cluster file not found", "cluster.yaml")


def test_unknown_device_lists_the_known_ones(capsys):
    assert_user_error(capsys, ["plan", GPT + ":gpt_tiny", "--device", "tpu-v9"], "'tpu-v9'", "h100-sxm", "dgx-h100")


@pytest.mark.parametrize("argv, needles", [
    (["--gpus", "12", "--device", "dgx-h100"], ["--gpus 12 is not a whole number of 8-GPU nodes", "--gpus 8 (1 node)",
                                                 "--gpus 16 (2 nodes)"]),
    (["--gpus", "7", "--gpus-per-node", "8"], ["--gpus 7 is less than --gpus-per-node 8"]),
    (["--gpus", "7"], ["--gpus 7 is part of one 8-GPU node", "--gpus 8", "--gpus 7 --gpus-per-node 7"]),
    (["--gpus", "6", "--device", "dgx-a100"], ["--gpus 6 is part of one 8-GPU node of dgx-a100"]),
    (["--gpus", "0"], ["--gpus must be a positive integer"]),
    (["--gpus", "16", "--tp", "3"], ["does not divide the 16 GPUs"]),
    (["--cluster", "x.yaml", "--device", "h100-sxm"], ["pass one of them"]),
])
def test_gpu_counts_that_do_not_factor(capsys, argv, needles):
    assert_user_error(capsys, ["plan", GPT + ":gpt_tiny", *argv], *needles)


# -- out of memory ----------------------------------------------------------------------------------
def test_model_that_fits_nowhere_says_what_would_fit(capsys, files):
    # its weights, gradients and Adam states exceed the GPUs' and the host's memory together:
    # refused before any search, with the GPU count and the device that could hold them (bounds)
    err = assert_user_error(capsys, ["plan", files["model"], "--cluster", files["oom"], "--time-limit", "0.2"],
                            "does not fit on 2 x tiny", "no layout was searched", "what would fit")
    assert re.search(r"--gpus \d+ at the least", err) and re.search(r"device: [\w.-]+ in .*oom.yaml at the least", err)
    assert "offload" in err.lower()


def test_out_of_memory_advice_uses_the_planners_numbers():
    exc = InfeasibleError("llama does not fit on 8 x a100-80g", min_bytes_per_gpu=120e9, capacity_bytes=85.9e9,
                          smallest_world=32, device="a100-80g")
    advice = infeasible_advice(exc)
    assert "120.0 GB per GPU (this device: 85.9 GB)" in advice
    assert "--gpus 32" in advice
    # a device is offered only when the planner planned on it and it fit (InfeasibleError.fixes):
    # a memory lower bound alone does not say that a larger device helps
    assert "h200" not in advice and "device" not in advice.replace("this device", "")
    assert infeasible_advice(InfeasibleError("no valid mesh for 7 GPUs")) is None  # not a memory problem


# -- plan files -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plan_dict(tmp_path_factory):
    out = subprocess.run([sys.executable, "-m", "autopar", "plan", GPT + ":gpt_tiny", "--gpus", "4", "--device",
                          "cpu", "--json", "--top", "1"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def edited(plan_dict, tmp_path, edit, name="plan.json"):
    d = json.loads(json.dumps(plan_dict))
    edit(d)
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return str(path)


def _set(d, keys, value):
    for k in keys[:-1]:
        d = d[k]
    d[keys[-1]] = value


@pytest.mark.parametrize("edit, needles", [
    (lambda d: d.__setitem__("schema_version", 99), ["schema version 99 is not supported", "reads version 1"]),
    (lambda d: d.pop("schema_version"), ["not an autopar plan (no schema_version field)"]),
    (lambda d: _set(d, ["mesh", "tp"], "eight"), ["mesh.tp must be a positive integer, got 'eight'"]),
    (lambda d: _set(d, ["mesh", "dp"], 3), ["global_batch_size 4 != dp 3"]),
    (lambda d: d.__setitem__("schedule", "zigzag"), ["schedule must be one of", "'zigzag'"]),
    (lambda d: _set(d, ["stages", 0, "layers", 0, "zero"], 5), ["stages[0].layers[0]", "zero must be 0, 1, 2 or 3"]),
    (lambda d: d["stages"][0].pop("pp_rank"), ["missing field 'pp_rank'"]),
    (lambda d: d.__setitem__("wandb_run", "x"), ["unknown fields: wandb_run"]),
])
def test_hand_edited_plan_names_the_bad_field(capsys, tmp_path, plan_dict, edit, needles):
    path = edited(plan_dict, tmp_path, edit)
    assert_user_error(capsys, ["report", "--plan", path, "-o", str(tmp_path / "r.html")], *needles)
    assert not (tmp_path / "r.html").exists()


def test_plan_file_that_is_not_json(capsys, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"schema_version": 1, "mesh": {"pp": ')
    assert_user_error(capsys, ["report", "--plan", path, "-o", tmp_path / "r.html"], "plan.json is not valid JSON")


def test_compile_a_plan_for_another_gpu_count(capsys, tmp_path, plan_dict):
    path = edited(plan_dict, tmp_path, lambda d: None)
    assert_user_error(capsys, ["compile", "--plan", path, "--gpus", "8", "-o", tmp_path / "build"],
                      "--gpus 8 but", "plan for 4 GPUs", "pass --gpus 4")


def test_compile_a_plan_of_another_model(capsys, tmp_path, plan_dict):
    path = edited(plan_dict, tmp_path, lambda d: None)
    llama = str(ROOT / "examples" / "llama.py") + ":llama_tiny"
    assert_user_error(capsys, ["compile", llama, "--plan", path, "-o", tmp_path / "build"],
                      "the model differs from the planned one")


def test_saved_plan_with_planning_flags_is_refused_not_silently_ignored(capsys, tmp_path, plan_dict):
    path = edited(plan_dict, tmp_path, lambda d: None)
    assert_user_error(capsys, ["report", "--plan", path, "--gpus", "8", "--tp", "2", "-o", tmp_path / "r.html"],
                      "--gpus, --tp would be ignored")


def test_compile_takes_the_model_from_the_plan(capsys, tmp_path, plan_dict):
    path = edited(plan_dict, tmp_path, lambda d: _set(d, ["model", "source"], GPT + ":gpt_tiny"))
    code, out, err = run_cli(capsys, "compile", "--plan", path, "-o", tmp_path / "build")
    assert code == 0, err
    assert "recorded in" in err and (tmp_path / "build" / "train.py").exists()


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_build_launched_on_the_wrong_number_of_ranks(tmp_path, plan_dict):
    path = edited(plan_dict, tmp_path, lambda d: _set(d, ["model", "source"], GPT + ":gpt_tiny"))
    assert main(["compile", "--plan", path, "-o", str(tmp_path / "build")]) == 0
    run = subprocess.run(["torchrun", "--nproc_per_node", "1", str(tmp_path / "build" / "train.py"), "--steps", "1",
                          "--synthetic"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0
    assert "the plan is for 4 ranks" in run.stderr and "this job has 1" in run.stderr
    assert "launch 4 processes" in run.stderr


# -- autopar's own bugs ---------------------------------------------------------------------------
def test_internal_error_is_one_line_and_exit_1(capsys, monkeypatch, tmp_path, plan_dict):
    import autopar.report

    def boom(*a, **k):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(autopar.report, "write_html", boom)
    path = edited(plan_dict, tmp_path, lambda d: None)
    code, out, err = run_cli(capsys, "report", "--plan", path, "-o", tmp_path / "r.html")
    assert code == 1
    assert "internal error: ZeroDivisionError" in err and "bug in autopar" in err and "AUTOPAR_DEBUG=1" in err


@pytest.mark.parametrize("argv, needles", [
    (["--html", "plan.txt"], ["--html plan.txt: the report file must end in .html"]),
    (["--html", "/no/such/dir/plan.html"], ["/no/such/dir does not exist"]),
    (["--time-limit", "0"], ["--time-limit must be a positive number"]),
    (["--batch-size", "0"], ["--batch-size must be a positive integer"]),
    (["--schedule", "zigzag"], ["'zigzag' is not a schedule", "interleaved:V"]),
])
def test_plan_flags_are_checked_before_planning(capsys, argv, needles):
    assert_user_error(capsys, ["plan", GPT + ":gpt_tiny", "--gpus", "8", *argv], *needles)


def test_a_mesh_that_cannot_exist_gets_no_out_of_memory_advice(capsys):
    # 8 pipeline stages for a 6-layer model: the fix is the layout, not more memory.
    err = assert_user_error(capsys, ["plan", GPT + ":gpt_tiny", "--gpus", "8", "--pp", "8"], "no valid mesh",
                            "more pipeline stages than the 6 layers")
    assert "what would fit" not in err and "device with more memory" not in err


def test_compile_a_plan_whose_recorded_model_is_not_here(capsys, tmp_path, plan_dict):
    path = edited(plan_dict, tmp_path, lambda d: _set(d, ["model", "source"], "somewhere/else/gpt.py:gpt_tiny"))
    assert_user_error(capsys, ["compile", "--plan", path, "-o", tmp_path / "build"],
                      "records its model as somewhere/else/gpt.py:gpt_tiny", "name the model file")


def test_autopar_debug_shows_the_traceback_of_an_internal_error(capsys, monkeypatch, tmp_path, plan_dict):
    import autopar.report

    monkeypatch.setattr(autopar.report, "write_html", lambda *a, **k: 1 / 0)
    monkeypatch.setenv("AUTOPAR_DEBUG", "1")
    path = edited(plan_dict, tmp_path, lambda d: None)
    assert main(["report", "--plan", path, "-o", str(tmp_path / "r.html")]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "internal error: ZeroDivisionError" in err
