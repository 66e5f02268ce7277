"""`autopar compile` writes a build/ that runs under torchrun and matches
the in-process compile."""
import json
import os
import py_compile
import subprocess
import sys

import pytest

import gpt
from autopar.cli import main as cli
from autopar.lower import plan_for_model
from autopar.plan import Plan
from conftest import EXAMPLES, ROOT, free_port
from dist_utils import run_world
from lower_worlds import emitted_reference_world

MODEL = f"{EXAMPLES / 'gpt.py'}:gpt_tiny"


def _plan_file(tmp_path, **kw):
    model, _ = gpt.gpt_tiny()
    plan = plan_for_model(model, **kw)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    return path, plan


def test_compile_writes_a_readable_build(tmp_path, capsys):
    plan_path, plan = _plan_file(tmp_path, pp=2, dp=2, schedule="1f1b", num_micro_batches=2)
    out = tmp_path / "build"
    assert cli(["compile", MODEL, "--plan", str(plan_path), "-o", str(out)]) == 0
    assert sorted(os.listdir(out)) == ["launch.sbatch", "launch.sh", "model.py", "plan.json", "train.py"]
    assert Plan.load(str(out / "plan.json")).to_dict() == plan.to_dict()
    py_compile.compile(str(out / "train.py"), doraise=True)
    train = (out / "train.py").read_text()
    assert "from autopar.train import main" in train and "pp=2 x dp=2 x tp=1" in train
    for script in ("launch.sh", "launch.sbatch"):
        assert subprocess.run(["bash", "-n", str(out / script)]).returncode == 0
        assert os.access(out / script, os.X_OK)
    sh = (out / "launch.sh").read_text()
    assert 'NPROC_PER_NODE="${NPROC_PER_NODE:-4}"' in sh and "torchrun" in sh
    sbatch = (out / "launch.sbatch").read_text()
    assert "#SBATCH --nodes=1" in sbatch and "--rdzv_backend c10d" in sbatch


def test_compile_refuses_mismatched_plans(tmp_path, capsys):
    plan_path, _ = _plan_file(tmp_path, dp=2)
    assert cli(["compile", MODEL, "--plan", str(plan_path), "--gpus", "8", "-o", str(tmp_path / "b")]) == 2
    assert "a plan for 2 GPUs" in capsys.readouterr().err
    other = f"{EXAMPLES / 'llama.py'}:llama_tiny"
    assert cli(["compile", other, "--plan", str(plan_path), "-o", str(tmp_path / "b")]) == 2
    assert "differs from the planned one" in capsys.readouterr().err
    d = json.loads(plan_path.read_text())
    d["schema_version"] = 0
    plan_path.write_text(json.dumps(d))
    assert cli(["compile", MODEL, "--plan", str(plan_path), "-o", str(tmp_path / "b")]) == 2
    assert "schema version 0" in capsys.readouterr().err


def test_launch_sh_stops_once_on_an_error_a_restart_cannot_fix(tmp_path):
    """Issue 32: torchrun restarted every rank into the same import or data error
    (4 times). launch.sh runs train.py --preflight in one process first: exit 2, one
    message, torchrun never started."""
    import time

    plan_path, _ = _plan_file(tmp_path, dp=2)
    out = tmp_path / "build"
    assert cli(["compile", MODEL, "--plan", str(plan_path), "-o", str(out)]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MAX_RESTARTS="3",
               MASTER_PORT=str(free_port()))
    t0 = time.monotonic()
    proc = subprocess.run([str(out / "launch.sh"), "--steps", "2", "--data", str(tmp_path / "missing.bin")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("no such file") == 1 and "torchrun" not in proc.stderr.lower(), proc.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    ok = subprocess.run([sys.executable, str(out / "train.py"), "--preflight", "--steps", "2", "--synthetic"],
                        capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0 and "preflight passed" in ok.stderr, ok.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_emitted_build_runs_under_torchrun_and_matches_in_process_compile(tmp_path):
    plan_path, _ = _plan_file(tmp_path, pp=2, dp=2, schedule="1f1b", num_micro_batches=2, micro_batch_size=2)
    out = tmp_path / "build"
    assert cli(["compile", MODEL, "--plan", str(plan_path), "-o", str(out)]) == 0
    losses_file = tmp_path / "losses.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr", "127.0.0.1",
         "--master_port", str(free_port()), str(out / "train.py"), "--steps", "3", "--synthetic",
         "--losses-out", str(losses_file)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    emitted = json.loads(losses_file.read_text())
    assert "step     2/3  loss" in proc.stdout and "eta 0s" in proc.stdout  # the last step: nothing left
    in_process = run_world(emitted_reference_world, 4, str(out), 3, timeout=200)
    for losses in in_process:
        assert len(emitted) == 3
        for a, b in zip(emitted, losses):
            assert abs(a - b) <= 1e-6 * abs(b), (emitted, losses)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_solver_plan_from_autopar_compile_lowers_and_matches_single_process(tmp_path):
    """The whole path: `autopar compile` plans (solver, cpu profile, layout
    partly pinned), and the written plan.json trains like one process."""
    from lower_worlds import GLOBAL_BATCH, equivalence_world
    out = tmp_path / "build"
    llama_model = f"{EXAMPLES / 'llama.py'}:llama_tiny"
    assert cli(["compile", llama_model, "--device", "cpu", "--gpus", "4", "--tp", "2", "--pp", "2",
                "--precision", "fp32", "--batch-size", str(GLOBAL_BATCH), "--time-limit", "2",
                "-o", str(out)]) == 0
    plan = Plan.load(str(out / "plan.json"))
    assert (plan.mesh.pp, plan.mesh.tp) == (2, 2) and plan.solver.get("status") != "manual"
    assert plan.model["param_shapes"]["output.weight"] == [128, 32]  # recorded for the model check
    results = run_world(equivalence_world, 4, "llama", [("solver", {"plan_json": str(out / "plan.json")})],
                        "sgd", timeout=200)
    r = results[0]["solver"]
    assert r["loss_rel"] < 1e-5 and r["param_rel"] < 1e-5, r


def test_emitted_training_feeds_hugging_face_models_their_labels(tmp_path):
    """A model file without loss_fn (a transformers causal LM): the runtime lets
    autopar use the model's own loss, whose labels are the inputs unshifted
    (transformers shifts them); a model file's loss_fn gets shifted targets,
    from --synthetic and from a token file alike. No data at all: one line."""
    import types
    import numpy as np
    import torch
    from autopar.errors import AutoparError
    from autopar.train.run import _dataset
    example = lambda b: (torch.randint(0, 100, (b, 8)),)  # noqa: E731
    model, _ = gpt.gpt_tiny()
    plan = plan_for_model(model)
    (np.arange(200, dtype=np.uint16) % 128).tofile(tmp_path / "t.bin")  # ids within gpt_tiny's vocabulary
    for loss_fn, shifted in ((gpt.loss_fn, True), (None, False)):
        loaded = types.SimpleNamespace(model=model, example_inputs=example, loss_fn=loss_fn)
        args = types.SimpleNamespace(data=None, synthetic=True, seed=0, data_dtype="uint16")
        (x,), y = _dataset(args, loaded, plan, None)[5]
        assert torch.equal(y[:-1], x[1:]) if shifted else torch.equal(y, x)
        args.data = str(tmp_path / "t.bin")
        (x,), y = _dataset(args, loaded, plan, None)[1]
        assert torch.equal(y, x + 1) if shifted else torch.equal(y, x)
    args = types.SimpleNamespace(data=None, synthetic=False, seed=0, data_dtype="uint16")
    with pytest.raises(AutoparError, match="no training data"):
        _dataset(args, loaded, plan, None)


def test_inferred_keyword_inputs_are_fed_positionally_with_labels_as_targets(tmp_path):
    """Capture infers `({"input_ids", "labels", "use_cache"},)` for a Hugging Face model file that
    defines no example_inputs; lowering feeds positional tensors, so train.py and autopar.compile
    split them: input_ids in forward order, labels as train_step's targets."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from autopar.errors import AutoparError
    from autopar.lower.model_io import positional_inputs
    from autopar.train.data import Synthetic
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    inferred = lambda b: ({"input_ids": torch.randint(0, 64, (b, 8)), "labels": torch.randint(0, 64, (b, 8)),  # noqa: E731
                           "use_cache": False},)
    split = positional_inputs(model, inferred)
    inputs, targets = split(3)
    assert len(inputs) == 1 and inputs[0].shape == (3, 8) and targets.shape == (3, 8)
    assert positional_inputs(model, lambda b: (torch.zeros(b, 8, dtype=torch.long),)) is None  # already positional
    with pytest.raises(AutoparError, match="not the first parameters"):  # a keyword the forward takes later
        positional_inputs(model, lambda b: ({"labels": torch.zeros(b, 8), "inputs_embeds": torch.zeros(b, 8, 32)},))(2)
    (x,), labels = Synthetic(inferred, shift=False, split=split)[0]
    assert x.shape == (8,) and labels.shape == (8,) and not torch.equal(labels, x)


def test_compile_refuses_a_model_file_with_no_loss_before_writing_a_build(tmp_path, capsys):
    """Issue 32: a model file without loss_fn whose model returns logits got a build/
    that train.py then refused at start ('autopar.compile needs loss_fn')."""
    model_file = tmp_path / "noloss.py"
    model_file.write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)\n"
        "        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(2)])\n"
        "    def forward(self, x):\n"
        "        h = self.emb(x)\n"
        "        for b in self.blocks:\n"
        "            h = b(h)\n"
        "        return self.head(h)\n"
        "def build_model():\n    return M()\n"
        "def example_inputs(b):\n    return (torch.randint(0, 64, (b, 8)),)\n")
    out = tmp_path / "build"
    assert cli(["compile", str(model_file), "--gpus", "2", "--device", "cpu", "--batch-size", "4", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "needs loss_fn" in err and "define loss_fn(logits, targets) in the model file" in err, err
    assert not out.exists()
    with_loss = tmp_path / "withloss.py"
    with_loss.write_text(model_file.read_text() + "import torch.nn.functional as F\n"
                         "def loss_fn(logits, targets):\n    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())\n")
    assert cli(["compile", str(with_loss), "--gpus", "2", "--device", "cpu", "--batch-size", "4", "-o", str(out)]) == 0


def test_a_build_runs_after_it_is_moved_with_the_neighbours_its_model_imports(tmp_path, capsys):
    """Issue 32: train.py hard-coded the folder the model file was in, so a build/ copied
    to a cluster failed to import the model's neighbours. The neighbours it imports are
    copied into build/src/; the build runs moved, the source folder gone."""
    import shutil

    src = tmp_path / "project"
    (src / "pkg_issue32").mkdir(parents=True)
    (src / "pkg_issue32" / "__init__.py").write_text("WIDTH = 32\n")
    (src / "net_issue32.py").write_text(
        "import torch.nn as nn\nfrom pkg_issue32 import WIDTH\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])\n"
        "    def forward(self, x):\n"
        "        for b in self.blocks:\n"
        "            x = b(x)\n"
        "        return x\n")
    (src / "train_me.py").write_text(
        "import torch\nimport torch.nn.functional as F\nfrom net_issue32 import Net\n"
        "def build_model():\n    return Net()\n"
        "def example_inputs(b):\n    return (torch.randn(b, 32),)\n"
        "def loss_fn(out, y):\n    return F.mse_loss(out, y)\n")
    out = src / "build"
    assert cli(["compile", str(src / "train_me.py"), "--gpus", "1", "--device", "cpu", "--batch-size", "2",
                "-o", str(out)]) == 0
    assert sorted(os.listdir(out / "src")) == ["net_issue32.py", "pkg_issue32"]
    moved = tmp_path / "elsewhere" / "build"
    shutil.move(str(out), str(moved))
    shutil.rmtree(src)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(moved / "train.py"), "--preflight", "--synthetic", "--steps", "1"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0 and "preflight passed" in proc.stderr, proc.stderr[-2000:]
