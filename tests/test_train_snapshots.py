"""Snapshots of the training job: resume-exact, resume under another plan and world
size, the directory's atomicity and retention, refusal of a foreign model, and a
safe read of DCP's metadata."""
import json
import math
import os
import pickle

import pytest
import torch

from autopar.errors import AutoparError
from autopar.train import snapshot
from dist_utils import run_world
from train_worlds import GPT_TINY, gpt_tiny_tokens, load_safetensors, main_world, write_plan

ARGS = ["--seed", "3", "--lr", "1e-2", "--warmup", "2", "--decay", "cosine", "--clip", "1.0", "--quiet",
        "--no-plot"]  # the plot is tested in test_train_plot.py; drawing it costs ~1 s a run


def _run(world, plan, tmp_path, name, extra, timeout=300):
    out = tmp_path / name
    argv = ARGS + ["--data", gpt_tiny_tokens(tmp_path), "--steps", "8", "--losses-out", str(out / "losses.json"),
                   "--export", str(out / "model.safetensors"), "--metrics", str(out / "metrics.jsonl")] + extra
    os.makedirs(out, exist_ok=True)
    rcs = run_world(main_world, world, GPT_TINY, plan, argv, timeout=timeout)
    assert rcs == [0] * world, rcs
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "losses.json").read_text()), load_safetensors(str(out / "model.safetensors")), rows


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_resume_exact_and_on_other_plans_and_world_sizes(tmp_path):
    """8 steps of FSDP dp 4 with a snapshot at step 4 (AdamW, warmup + cosine, clipping).
    From that snapshot: the same plan continues bit for bit (losses and final weights
    equal); pp 2 x tp 2 on 4 ranks and tp 2 on 2 ranks continue with the same losses and
    weights as the uninterrupted run, to the lowering tests' tolerance, data order included."""
    dp4 = write_plan(str(tmp_path / "dp4.json"), dp=4, zero=3, micro_batch_size=2)
    ref_losses, ref_weights, _ = _run(4, dp4, tmp_path, "ref",
                                      ["--save-dir", str(tmp_path / "ckpt"), "--save-every", "4", "--keep", "0"])
    snap4 = str(tmp_path / "ckpt" / "step-00000004")
    assert [s for s, _ in snapshot.complete(str(tmp_path / "ckpt"))] == [4, 8]
    assert json.loads(open(os.path.join(snap4, "autopar.json")).read())["mesh"] == {"pp": 1, "dp": 4, "tp": 1}

    losses, weights, rows = _run(4, dp4, tmp_path, "same", ["--resume", snap4])
    assert losses == ref_losses[4:]  # bit for bit
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights) and weights.keys() == ref_weights.keys()
    assert [r["step"] for r in rows] == [4, 5, 6, 7]

    # `autopar export`, offline on one process: the newest snapshot (step 8) is the run's final model.
    from autopar.cli import main as cli
    assert cli(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "step8.safetensors")]) == 0
    exported = load_safetensors(str(tmp_path / "step8.safetensors"))
    assert exported.keys() == ref_weights.keys() and all(torch.equal(exported[k], ref_weights[k]) for k in exported)
    # every key state_dict() has, the tied head too (issue 32: it was missing, so a strict load failed)
    import gpt
    fresh = gpt.gpt_tiny()[0]
    fresh.load_state_dict(exported, strict=True)
    assert "lm_head.weight" in exported and fresh.lm_head.weight is fresh.wte.weight  # still tied after the load

    others = [(4, write_plan(str(tmp_path / "pp2tp2.json"), pp=2, tp=2, micro_batch_size=4, num_micro_batches=2,
                                    schedule="1f1b"), "pp2_tp2"),
              (2, write_plan(str(tmp_path / "tp2.json"), tp=2, micro_batch_size=8), "tp2_on_2_ranks")]
    for world, plan, name in others:
        losses, weights, _ = _run(world, plan, tmp_path, name, ["--resume", str(tmp_path / "ckpt" / "step-00000004")])
        rel = max(abs(a - b) / b for a, b in zip(losses, ref_losses[4:]))
        assert len(losses) == 4 and rel < 1e-4, (name, losses, ref_losses[4:])
        worst = max(((weights[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item()
                    for k, v in ref_weights.items())
        assert worst < 1e-3, (name, worst)  # test_lower_equivalence's Adam tolerance


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp16_resume_continues_the_loss_scale(tmp_path):
    """An fp16 plan (FSDP dp 2) through train.py: the metrics carry the scale each step
    used and the skipped steps (the scale halves after each, doubles after 3 clean ones);
    the snapshot holds the scaler and the schedule's position (skipped steps do not advance
    it, as in Megatron and DeepSpeed), and resuming at step 4 repeats steps 4-7 bit for bit."""
    plan = write_plan(str(tmp_path / "fp16.json"), dp=2, zero=3, micro_batch_size=4, precision="fp16")
    fp16 = ["--initial-loss-scale", str(2 ** 20), "--loss-scale-window", "3"]
    ref_losses, ref_weights, rows = _run(2, plan, tmp_path, "ref", fp16 + [
        "--save-dir", str(tmp_path / "ckpt"), "--save-every", "4", "--keep", "0"])
    scales, ref_lrs = [r["loss_scale"] for r in rows], [r["lr"] for r in rows]
    assert rows[0]["skipped"] and scales[0] == 2 ** 20, rows[0]  # 2**20 overflows gpt_tiny's fp16 backward
    clean = 0
    for prev, now, row in zip(scales, scales[1:], rows):
        clean = 0 if row["skipped"] else clean + 1
        expected = prev / 2 if row["skipped"] else prev * 2 if clean == 3 else prev
        clean = 0 if clean == 3 else clean
        assert now == expected, scales
    assert not all(r["skipped"] for r in rows) and all(math.isfinite(l) for l in ref_losses)
    meta = json.loads(open(tmp_path / "ckpt" / "step-00000004" / "autopar.json").read())
    assert meta["loss_scaler"]["scale"] == scales[4], (meta, scales)

    losses, weights, rows = _run(2, plan, tmp_path, "resumed", fp16 + [
        "--resume", str(tmp_path / "ckpt" / "step-00000004")])
    assert losses == ref_losses[4:] and [r["loss_scale"] for r in rows] == scales[4:]
    assert [r["lr"] for r in rows] == ref_lrs[4:]
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)


def test_metadata_reader_admits_dcp_classes_only(tmp_path):
    """DCP's .metadata is a pickle: a snapshot that names any other callable is refused."""
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        snapshot.SafeFileSystemReader(str(tmp_path)).read_metadata()


def test_export_refuses_what_is_not_a_snapshot(tmp_path, capsys):
    from autopar.cli import main as cli
    (tmp_path / "step-00000004.partial").mkdir()
    assert cli(["export", str(tmp_path), "-o", str(tmp_path / "m.safetensors")]) == 2
    assert "holds no complete snapshot" in capsys.readouterr().err
    assert cli(["export", str(tmp_path / "nowhere")]) == 2
    assert not (tmp_path / "m.safetensors").exists()


def test_only_complete_snapshots_count(tmp_path):
    root = tmp_path / "ckpt"
    for name, files in [("step-00000005", [".metadata", "autopar.json"]), ("step-00000010.partial", [".metadata"]),
                        ("step-00000015", [".metadata"]), ("notes", [])]:
        os.makedirs(root / name)
        for f in files:
            (root / name / f).write_text(json.dumps({"format": "autopar-snapshot", "version": 1, "step": 5}))
    assert snapshot.complete(str(root)) == [(5, str(root / "step-00000005"))]
    assert snapshot.resolve("auto", str(root)) == str(root / "step-00000005")
    assert snapshot.resolve(str(root), None) == str(root / "step-00000005")
    assert snapshot.resolve("never", str(root)) is None
    with pytest.raises(AutoparError, match="no complete snapshot"):
        snapshot.resolve(str(tmp_path / "empty"), None)


SLOW_MODEL = '''
import sys, time
sys.path.insert(0, {examples!r})
from torch.utils.data import Dataset
from gpt import gpt_tiny, loss_fn
from autopar.train.data import TokenFile


class SlowTokens(Dataset):
    """Token windows read at 20 ms a sample: a step lasts long enough to kill a rank in it."""
    def __init__(self):
        self.tokens = TokenFile({tokens!r}, 16)
    def __len__(self):
        return len(self.tokens)
    def __getitem__(self, i):
        time.sleep(0.02)
        return self.tokens[i]


def dataset():
    return SlowTokens()
'''


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        return int(env[b"RANK"]) if b"RANK" in env else None
    except (OSError, ValueError):
        return None


def _slow_job(tmp_path):
    """(build dir, train.py args, reference export): gpt_tiny on FSDP dp 2 reading a
    slow dataset, emitted by write_build, and its uninterrupted 16-step run's weights."""
    from autopar.lower.emit import write_build
    from autopar.plan import Plan
    from train_worlds import EXAMPLES

    model_file = tmp_path / "slow_gpt.py"
    model_file.write_text(SLOW_MODEL.format(examples=EXAMPLES, tokens=gpt_tiny_tokens(tmp_path)))
    plan_path = write_plan(str(tmp_path / "dp2.json"), dp=2, zero=3, micro_batch_size=4)
    build = tmp_path / "build"
    write_build(str(build), Plan.load(plan_path), f"{model_file}:gpt_tiny")
    argv = ARGS + ["--steps", "16", "--save-every", "4"]
    ref = tmp_path / "ref.safetensors"
    assert run_world(main_world, 2, f"{model_file}:gpt_tiny", plan_path,
                     argv + ["--export", str(ref)], timeout=300) == [0, 0]
    return build, argv, ref


def _launch(build, argv, ckpt, export, log, **env):
    import subprocess
    from dist_utils import free_port
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([str(build / "launch.sh"), *argv, "--save-dir", str(ckpt), "--export", str(export)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def _assert_as_uninterrupted(tmp_path, ckpt, ref):
    final, expected = load_safetensors(str(tmp_path / "final.safetensors")), load_safetensors(str(ref))
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    rows = [json.loads(line) for line in (ckpt / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(16))  # one row a step, replayed steps once


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_saves_stops_and_the_same_command_continues(tmp_path):
    """SIGTERM to one rank (a preemption notice): every rank finishes the step in
    flight, saves that step, exits 0; the same command run again resumes there and
    ends with the uninterrupted run's weights bit for bit."""
    import signal
    import time
    build, argv, ref = _slow_job(tmp_path)
    ckpt = tmp_path / "ckpt"
    log = open(tmp_path / "job.log", "w")
    job = _launch(build, argv, ckpt, tmp_path / "final.safetensors", log, MAX_RESTARTS="0")
    sent, deadline = False, time.monotonic() + 240
    while not sent and job.poll() is None and time.monotonic() < deadline:
        metrics = ckpt / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            victims = [p for p in _children(job.pid) if _rank_of(p) == 1]
            if victims:
                os.kill(victims[0], signal.SIGTERM)
                sent = True
        time.sleep(0.01)
    assert job.wait(timeout=300) == 0
    text = (tmp_path / "job.log").read_text()
    assert sent and "stopped by signal after step" in text, text[-3000:]
    stopped = snapshot.complete(str(ckpt))[-1][0]
    assert 2 <= stopped < 16 and f"stopped by signal after step {stopped} (snapshot at step {stopped}" in text, \
        (stopped, text[-2000:])  # the step in flight when the signal came, saved
    log = open(tmp_path / "job2.log", "w")
    assert _launch(build, argv, ckpt, tmp_path / "final.safetensors", log).wait(timeout=300) == 0
    assert f"at step {stopped}" in (tmp_path / "job2.log").read_text()
    _assert_as_uninterrupted(tmp_path, ckpt, ref)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_finishes_the_step_saves_and_the_same_command_continues(tmp_path):
    """Ctrl-C in the terminal (SIGINT to the job's whole process group: launch.sh, torchrun
    and every rank): as SIGTERM, every rank finishes the step in flight and saves it, and
    the same command continues to the uninterrupted run's weights bit for bit (issue 32:
    before, every rank printed a KeyboardInterrupt traceback and nothing was saved)."""
    import signal
    import subprocess
    from dist_utils import free_port, signal_after_rows
    build, argv, ref = _slow_job(tmp_path)
    ckpt = tmp_path / "ckpt"
    log = open(tmp_path / "job.log", "w")
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "MAX_RESTARTS": "0"}
    job = subprocess.Popen([str(build / "launch.sh"), *argv, "--save-dir", str(ckpt), "--export",
                            str(tmp_path / "final.safetensors")], stdout=log, stderr=subprocess.STDOUT, env=env,
                           start_new_session=True)  # its own process group, as a terminal's foreground job
    sent = signal_after_rows(job, ckpt / "metrics.jsonl", lambda: os.killpg(job.pid, signal.SIGINT))
    job.wait(timeout=300)
    text = (tmp_path / "job.log").read_text()
    assert sent and "stopped by signal after step" in text and "KeyboardInterrupt" not in text, text[-3000:]
    stopped = snapshot.complete(str(ckpt))[-1][0]
    assert 2 <= stopped < 16 and f"snapshot at step {stopped}" in text, (stopped, text[-2000:])
    log = open(tmp_path / "job2.log", "w")
    assert _launch(build, argv, ckpt, tmp_path / "final.safetensors", log).wait(timeout=300) == 0
    assert f"at step {stopped}" in (tmp_path / "job2.log").read_text()
    _assert_as_uninterrupted(tmp_path, ckpt, ref)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_rank_restarts_and_finishes_as_uninterrupted(tmp_path):
    """launch.sh (torchrun --max_restarts) on 2 ranks: rank 1 is SIGKILLed after the
    first snapshot, torchrun restarts both, train.py resumes from the newest complete
    snapshot, and the final weights equal an uninterrupted run's bit for bit."""
    import signal
    import time
    build, argv, ref = _slow_job(tmp_path)
    ckpt = tmp_path / "ckpt"
    log = open(tmp_path / "job.log", "w")
    job = _launch(build, argv, ckpt, tmp_path / "final.safetensors", log, MAX_RESTARTS="2")
    killed = None
    deadline = time.monotonic() + 240
    while killed is None and job.poll() is None and time.monotonic() < deadline:
        if snapshot.complete(str(ckpt)):
            victims = [p for p in _children(job.pid) if _rank_of(p) == 1]
            if victims:
                os.kill(victims[0], signal.SIGKILL)
                killed = snapshot.complete(str(ckpt))[-1][0]
        time.sleep(0.01)
    rc = job.wait(timeout=300)
    log.close()
    text = (tmp_path / "job.log").read_text()
    assert killed is not None and killed < 16, text[-3000:]
    assert rc == 0, text[-3000:]
    assert "resuming from" in text, text[-3000:]
    _assert_as_uninterrupted(tmp_path, ckpt, ref)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fresh_runs_start_from_the_same_weights_on_any_layout(tmp_path):
    """train.py builds the parameters on the meta device and initialises each rank's
    shards (--init auto: gpt's own _init_weights): FSDP dp 2 and tp 2 start from the
    same weights bit for bit (one step at lr 0, then --export), and so would one process."""
    weights = {}
    for name, layout in (("dp2", dict(dp=2, zero=3, micro_batch_size=4)), ("tp2", dict(tp=2, micro_batch_size=8))):
        plan = write_plan(str(tmp_path / f"{name}.json"), **layout)
        out = tmp_path / f"{name}.safetensors"
        assert run_world(main_world, 2, GPT_TINY, plan, ["--synthetic", "--steps", "1", "--lr", "0", "--quiet",
                                                         "--export", str(out)], timeout=200) == [0, 0]
        weights[name] = load_safetensors(str(out))
    assert weights["dp2"].keys() == weights["tp2"].keys()
    assert all(torch.equal(weights["dp2"][k], weights["tp2"][k]) for k in weights["dp2"])
    w = weights["dp2"]["blocks.0.mlp.fc.weight"]
    assert abs(w.std().item() - 0.02) < 0.002 and not torch.equal(w[: w.shape[0] // 2], w[w.shape[0] // 2:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_snapshot_of_another_model_is_named_as_such(tmp_path, capfd):
    """Issue 32: a Llama run resumed from a GPT snapshot with another global batch was
    told 'the snapshot was trained on another data order'; the model is compared first."""
    from autopar.lower.manual_plan import plan_for_model
    from llama import llama_tiny

    gpt_plan = write_plan(str(tmp_path / "gpt.json"), micro_batch_size=2)
    _run(1, gpt_plan, tmp_path, "gpt", ["--save-dir", str(tmp_path / "ckpt"), "--save-every", "4"])
    model, example = llama_tiny()
    llama_plan = str(tmp_path / "llama.json")
    plan_for_model(model, example_inputs=example, name="llama_tiny", micro_batch_size=4).save(llama_plan)
    capfd.readouterr()
    argv = ARGS + ["--data", gpt_tiny_tokens(tmp_path), "--steps", "8", "--resume", str(tmp_path / "ckpt")]
    spec = os.path.join(os.path.dirname(GPT_TINY.rpartition(":")[0]), "llama.py") + ":llama_tiny"
    assert run_world(main_world, 1, spec, llama_plan, argv, timeout=200) == [2]
    err = capfd.readouterr().err
    assert "holds another model" in err and "data order" not in err, err[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_changed_schedule_on_resume_is_refused_or_rebuilt_when_asked(tmp_path, capfd):
    """Issue 32: --steps changed on resume silently re-stretched the cosine schedule (lr
    1.02e-4 at step 39, 2.05e-4 at step 40). Refused with the values that differ;
    --reschedule rebuilds it and says so."""
    plan = write_plan(str(tmp_path / "gpt.json"), micro_batch_size=2)
    _run(1, plan, tmp_path, "first", ["--save-dir", str(tmp_path / "ckpt"), "--save-every", "4"])
    capfd.readouterr()
    argv = ARGS + ["--data", gpt_tiny_tokens(tmp_path), "--steps", "12", "--resume", str(tmp_path / "ckpt" / "step-00000004")]
    assert run_world(main_world, 1, GPT_TINY, plan, argv, timeout=200) == [2]
    err = capfd.readouterr().err
    assert "learning-rate schedule differs" in err and "--steps 8 -> 12" in err and "--reschedule" in err, err
    assert run_world(main_world, 1, GPT_TINY, plan, argv + ["--reschedule"], timeout=200) == [0]
    assert "the learning-rate schedule is rebuilt (--steps 8 -> 12)" in capfd.readouterr().err


# -- one process, in this one: what a resume restores and refuses (issue 35 item 4) -------
@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank in this process (snapshots are collectives)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _tiny_pm(precision="fp32"):
    """gpt_tiny compiled on the one rank (micro-batch 2, SGD)."""
    import gpt
    from autopar.lower import compile, plan_for_model
    torch.manual_seed(0)
    model, example = gpt.gpt_tiny()
    return compile(model, example_inputs=example, loss_fn=gpt.loss_fn, optimizer=torch.optim.SGD,
                   optimizer_kwargs={"lr": 0.1}, plan=plan_for_model(model, precision=precision, micro_batch_size=2))


def _tokens(step):
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(step))
    return (x,), x


def test_a_resumed_loss_scaler_keeps_its_count_of_clean_steps(tmp_path, one_rank):
    """Guards the mutation 'the scaler's growth tracker not restored on resume' (issue 35
    item 4b). fp16, the scale doubling after 3 clean steps: a snapshot taken after 2 clean
    steps and loaded into a freshly configured job doubles the scale after 1 more step, as
    the uninterrupted run does (not after 3, as a tracker started afresh would)."""
    run = _tiny_pm("fp16")
    run.grad_scaler.configure(init_scale=2.0 ** 2, growth_interval=3)
    for step in range(2):
        run.train_step(*_tokens(step))
        assert not run.last_step_skipped
    path = snapshot.save(run, str(tmp_path / "ckpt"), 2, {})
    resumed = _tiny_pm("fp16")
    resumed.grad_scaler.configure(init_scale=2.0 ** 2, growth_interval=3)  # as train.py configures, then loads
    snapshot.load(resumed, path)
    for pm in (run, resumed):
        pm.train_step(*_tokens(2))
        assert not pm.last_step_skipped and pm.grad_scaler.scale_value() == 2.0 ** 3


def test_a_snapshot_takes_its_step_name_only_once_every_shard_is_written(tmp_path, one_rank, monkeypatch):
    """Guards the mutation 'a snapshot renamed to its final name before all ranks wrote it'
    (issue 35 item 4c). While DCP writes the shards (every rank's, then .metadata), no
    directory of the step's final name exists. A write cut off there leaves the previous
    snapshot the newest complete one and no step directory of its own; an older run's
    complete snapshot of the same step keeps its files until the new one is whole."""
    import hashlib
    import torch.distributed.checkpoint as dcp

    pm = _tiny_pm()
    root = str(tmp_path / "ckpt")
    snapshot.save(pm, root, 2, {})
    old4 = snapshot.save(pm, root, 4, {})  # an earlier run's snapshot of step 4 (--resume never)
    files = lambda d: {f: hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()  # noqa: E731
                       for f in sorted(os.listdir(d))}
    before = files(old4)
    pm.train_step(*_tokens(0))  # other weights: other shard files
    real, seen = dcp.save, []

    def cut_off(state, *, storage_writer):
        seen.append((sorted(os.listdir(root)), files(old4)))
        real(state, storage_writer=storage_writer)
        seen.append((sorted(os.listdir(root)), files(old4)))
        raise RuntimeError("a rank died before the snapshot was complete")

    monkeypatch.setattr(dcp, "save", cut_off)
    with pytest.raises(RuntimeError, match="a rank died"):
        snapshot.save(pm, root, 6, {})
    assert len(seen) == 2 and all("step-00000006" not in names for names, _ in seen), seen
    assert not os.path.exists(snapshot.step_dir(root, 6))
    seen.clear()
    with pytest.raises(RuntimeError, match="a rank died"):
        snapshot.save(pm, root, 4, {})
    assert len(seen) == 2 and all(old == before for _, old in seen)  # the old step 4, untouched meanwhile
    assert [s for s, _ in snapshot.complete(root)] == [2, 4] and files(old4) == before
    monkeypatch.setattr(dcp, "save", real)
    assert snapshot.save(pm, root, 4, {}) == old4 and files(old4) != before  # once whole, the new one wins


def test_a_resume_on_another_data_order_is_refused(tmp_path, one_rank):
    """Guards the mutation 'resume accepted on a different data order' (issue 35 item 4d):
    train.py's resume of a snapshot written with seed 3 on a 64-sample token file at global
    batch 2 goes on with the same settings, and is refused with the reason for another
    --seed or another --data (another number of samples); another global batch reads on
    from where the saved run was."""
    from autopar.train import run
    from autopar.train.data import GlobalBatches, TokenFile

    pm = _tiny_pm()
    data = TokenFile(gpt_tiny_tokens(tmp_path), 16)
    other = tmp_path / "other"
    other.mkdir()
    args = run.parser().parse_args(["--seed", "3", "--steps", "8", "--resume", str(tmp_path / "ckpt")])
    batches = GlobalBatches(data, 2, 1, 0, seed=3)
    snapshot.save(pm, str(tmp_path / "ckpt"), 4, {"data": batches.state_dict(), "seed": 3,
                                                  "schedule": run._schedule(args)})
    assert run._resume(args, pm, GlobalBatches(data, 2, 1, 0, seed=3)) == (4, 4)
    for changed in (GlobalBatches(data, 2, 1, 0, seed=4),
                    GlobalBatches(TokenFile(gpt_tiny_tokens(other, n=80 * 16 + 1), 16), 2, 1, 0, seed=3)):
        with pytest.raises(AutoparError, match="another data order"):
            run._resume(args, pm, changed)
    # another global batch is the same order read on from where the saved run was (issue 32)
    grown = GlobalBatches(data, 4, 1, 0, seed=3)
    assert run._resume(args, pm, grown) == (4, 4) and grown.phase == {"step": 4, "offset": 8}
