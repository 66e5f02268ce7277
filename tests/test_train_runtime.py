"""The training runtime (autopar/train): data each rank reads, the learning-rate
schedule, metrics and alerts, and clipping by the global gradient norm on sharded
layouts against one process."""
import json
import math

import numpy as np
import pytest
import torch

from autopar.errors import AutoparError
from autopar.train.data import GlobalBatches, Synthetic, TokenFile
from autopar.train.metrics import Metrics
from autopar.train.schedule import lr_factor, lr_scheduler
from dist_utils import run_world


def _token_file(tmp_path, n=1025, vocab=128, dtype=np.uint16, seed=0):
    path = tmp_path / "tokens.bin"
    np.random.default_rng(seed).integers(0, vocab, n).astype(dtype).tofile(path)
    return str(path)


def test_token_file_windows_and_next_token_targets(tmp_path):
    path = _token_file(tmp_path, n=101)
    tokens = np.fromfile(path, dtype=np.uint16)
    ds = TokenFile(path, seq_len=10)
    assert len(ds) == 10  # (101 - 1) // 10: every window has its next-token target
    (x,), y = ds[3]
    assert x.tolist() == tokens[30:40].tolist() and y.tolist() == tokens[31:41].tolist()
    assert x.dtype == torch.long
    (x,), labels = TokenFile(path, 10, shift=False)[3]  # a Hugging Face model shifts its labels itself
    assert torch.equal(x, labels)
    np.arange(50, dtype=np.uint32).tofile(tmp_path / "t32.bin")
    assert TokenFile(str(tmp_path / "t32.bin"), 7, "uint32")[1][0][0].tolist() == list(range(7, 14))
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(AutoparError, match="not a whole number of uint16"):
        TokenFile(str(tmp_path / "odd.bin"), 4)
    with pytest.raises(AutoparError, match="fewer than one sample"):
        TokenFile(path, 200)


def test_token_ids_outside_the_vocabulary_are_refused_with_their_place(tmp_path, monkeypatch):
    """Issue 32: an id >= the vocabulary gave a bare `IndexError: index out of range in
    self` on one rank in the first step. Refused when the file is opened, with its
    token and byte offset; a file too large to scan is checked sample by sample."""
    from autopar.train.run import _vocab_size

    ids = np.arange(100, dtype=np.uint16) % 50
    ids[73] = 50
    path = tmp_path / "tokens.bin"
    ids.tofile(path)
    assert len(TokenFile(str(path), 8)) == 12  # no vocabulary given: not checked
    with pytest.raises(AutoparError, match="token 50 at token offset 73 \\(byte 146\\) .* vocabulary of 50"):
        TokenFile(str(path), 8, vocab_size=50)
    monkeypatch.setattr(TokenFile, "SCAN_TOKENS", 10)  # a large file: each sample as it is read
    data = TokenFile(str(path), 8, vocab_size=50)
    assert data[0][0][0].shape == (8,)
    with pytest.raises(AutoparError, match="token offset 73"):
        data[9]  # tokens 72..80
    emb = torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Embedding(16, 4))  # tokens, positions
    assert _vocab_size(emb) == 50 and _vocab_size(torch.nn.Linear(2, 2)) is None


def test_each_dp_rank_reads_its_share_of_the_same_global_batches(tmp_path):
    """Step k trains on global batch k whatever dp is: the dp ranks' shares, in rank
    order, are the dp = 1 batch; the order is the seed's; a new epoch reshuffles."""
    ds = TokenFile(_token_file(tmp_path), seq_len=16)  # 64 samples
    whole = GlobalBatches(ds, 8, 1, 0, seed=3)
    for dp in (2, 4, 8):
        for step in (0, 5, 9):  # 9: second epoch
            shares = [GlobalBatches(ds, 8, dp, r, seed=3).batch(step) for r in range(dp)]
            (x,), y = whole.batch(step)
            assert torch.equal(torch.cat([s[0][0] for s in shares]), x)
            assert torch.equal(torch.cat([s[1] for s in shares]), y)
    epoch0 = sorted(i for k in range(8) for i in whole.indices(k))
    assert epoch0 == list(range(64))  # an epoch visits every sample once
    assert whole.indices(8) != whole.indices(0)  # the next epoch's order differs
    assert GlobalBatches(ds, 8, 1, 0, seed=4).indices(0) != whole.indices(0)
    with pytest.raises(AutoparError, match="another data order"):
        whole.resume({**whole.state_dict(), "seed": 4}, 3)
    with pytest.raises(AutoparError, match="does not split over dp=3"):
        GlobalBatches(ds, 8, 3, 0)


def test_synthetic_samples_do_not_touch_the_training_rng():
    ds = Synthetic(lambda b: (torch.randint(0, 50, (b, 6)),), seed=1)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    (x,), y = ds[4]
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(y[:-1], x[1:]) and torch.equal(ds[4][0][0], x)
    with pytest.raises(AutoparError, match="not token ids"):
        Synthetic(lambda b: (torch.randn(b, 3, 8, 8),))[0]


def test_learning_rate_warmup_then_decay():
    f = lambda s, d="cosine": lr_factor(s, warmup=10, total=110, decay=d, min_ratio=0.1)  # noqa: E731
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55) and f(110) == pytest.approx(0.1)
    assert f(60, "linear") == pytest.approx(0.55) and f(35, "linear") == pytest.approx(1 - 0.9 * 0.25)
    assert f(35, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert f(500) == pytest.approx(0.1)  # past the end: the floor
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = lr_scheduler(opt, warmup=2, total=4, decay="linear", min_ratio=0.0)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([1.0, 2.0, 2.0, 1.0])
    again = lr_scheduler(torch.optim.SGD([p], lr=2.0), warmup=2, total=4, decay="linear", min_ratio=0.0)
    again.load_state_dict(sched.state_dict())  # a snapshot's one counter resumes it
    assert again.get_last_lr() == sched.get_last_lr()
    with pytest.raises(AutoparError, match="--decay"):
        lr_scheduler(opt, warmup=0, total=4, decay="step")


class _Plan:
    predicted = {"step_time_s": 0.5, "tokens_per_s": 1024 / 0.5, "mfu": 0.4, "peak_memory_bytes": [3e9, 4e9]}
    seq_len, global_batch_size = 128, 8


def test_metrics_rows_hold_measured_and_predicted_values(tmp_path):
    path = tmp_path / "m.jsonl"
    alerts = []
    m = Metrics(_Plan(), path=str(path), callbacks=[alerts.append])
    m.record(0, loss=2.0, step_time_s=1.0, grad_norm=0.7, lr=1e-3, peak_memory_bytes=None)
    m.record(1, loss=1.9, step_time_s=0.25, grad_norm=0.6, lr=1e-3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 2
    r = rows[1]
    for key in ("loss", "grad_norm", "lr", "loss_scale", "step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes",
                "predicted_step_time_s", "predicted_tokens_per_s", "predicted_mfu", "predicted_peak_memory_bytes"):
        assert key in r, key
    assert r["tokens_per_s"] == pytest.approx(1024 / 0.25) and r["predicted_tokens_per_s"] == pytest.approx(2048)
    assert r["mfu"] == pytest.approx(0.4 * 0.5 / 0.25)  # the plan's FLOPs over the measured time
    assert r["predicted_peak_memory_bytes"] == 4e9  # the fullest rank
    assert alerts == []
    assert "0.5 s predicted" in m.summary()


def test_summary_says_when_a_cpu_plan_was_priced_without_a_measured_profile():
    plan = _Plan()
    plan.cluster = {"device": "cpu", "world_size": 4}
    m = Metrics(plan)
    m.record(0, loss=2.0, step_time_s=1.0)
    assert "autopar calibrate --device cpu --ranks 4" in m.summary()
    plan.cluster = {"device": "cpu", "devices": {"cpu": {"name": "cpu", "measured": {"gemm": []}}}}
    assert Metrics(plan).uncalibrated() is None  # priced with this machine's profile
    plan.cluster = {"device": "h100-80g"}
    assert Metrics(plan).uncalibrated() is None


def test_alerts_for_nonfinite_values_loss_spikes_and_stragglers():
    alerts = []
    m = Metrics(_Plan(), callbacks=[alerts.append])
    for step in range(6):
        m.record(step, loss=2.0 - 0.01 * step, step_time_s=0.5, rank_times=[0.5, 0.5, 0.5, 0.5])
    assert alerts == []
    m.record(6, loss=float("nan"), step_time_s=0.5)
    m.record(7, loss=1.9, step_time_s=0.5, grad_norm=float("inf"))
    m.record(8, loss=9.0, step_time_s=0.5)
    m.record(9, loss=1.9, step_time_s=1.2, rank_times=[0.5, 0.5, 1.2, 0.5])
    assert [(a.step, a.kind) for a in alerts] == [(6, "nonfinite"), (7, "nonfinite"), (8, "loss_spike"),
                                                   (9, "straggler")]
    assert "rank 2" in alerts[-1].message


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_clipping_schedule_and_data_shares_match_one_process(tmp_path):
    """Four ranks, each reading only its dp share of a token file: FSDP (dp 4), pp 2 x tp 2,
    dp 2 x tp 2 (FSDP + TP) and pp 2 x dp 2 with a tied embedding on both pipeline ends,
    AdamW with biases and norms undecayed, warmup + cosine, clipping at a norm every step
    exceeds: the global gradient norm, the losses and the parameters after 4 steps equal
    one process running torch's clip_grad_norm_ on the whole batch."""
    from lower_worlds import training_runtime_world
    path = _token_file(tmp_path, n=64 * 16 + 1)
    layouts = [("fsdp_dp4", dict(dp=4, zero=3)),
               ("pp2_tp2", dict(pp=2, tp=2, schedule="1f1b", num_micro_batches=2)),
               ("dp2_tp2_zero3", dict(dp=2, tp=2, zero=3)),
               ("tied_pp2_dp2", dict(model="llama_tied", pp=2, dp=2, zero=3, schedule="1f1b",
                                     num_micro_batches=2))]
    results = run_world(training_runtime_world, 4, path, layouts, timeout=500)
    for name, r in results[0].items():
        assert min(r["ref_norms"]) > 0.05, r  # every step clipped
        # The first step's norm is the same gradients summed per shard, then across ranks:
        # equal to fp32 rounding. Later steps carry tensor-parallel matmul rounding,
        # which Adam's normalised update amplifies in the near-zero gradient entries.
        assert abs(r["norms"][0] / r["ref_norms"][0] - 1) < 1e-6, (name, r["norms"], r["ref_norms"])
        assert r["norm_rel"] < 1e-4, (name, r["norms"], r["ref_norms"])
        assert r["loss_rel"] < 1e-4 and r["param_rel"] < 1e-3, (name, r)  # test_lower_equivalence: Adam 1e-3
    assert all(res == results[0] for res in results[1:])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fp16_loss_scaling_skips_together_and_matches_one_process(tmp_path):
    """fp16 plans on 2 ranks (FSDP dp 2, tp 2, pp 2 with 1F1B) against one process running
    the classic fp16 loop (fp16 copy of fp32 master weights, scaled loss, skip on Inf):
    the initial scale 2**16 overflows at step 0 on every rank; at step 2 only the last rank
    finds an Inf, and every rank skips; three clean steps double the scale. Scales and
    skipped steps equal the reference's, losses agree to fp16 rounding and parameters
    after 8 steps to 1e-4 (one batch and two halves of it differ by 7e-5 in fp16)."""
    from lower_worlds import fp16_world
    layouts = [("fsdp_dp2", dict(dp=2, zero=3)), ("tp2", dict(tp=2)),
               ("pp2_1f1b", dict(pp=2, schedule="1f1b", num_micro_batches=2))]
    results = run_world(fp16_world, 2, _token_file(tmp_path, n=64 * 16 + 1), layouts, 8, 2.0 ** 16, timeout=500)
    ref = results[0].pop("ref")
    assert ref["skipped"] == [True, False, True, False, False, False, False, False], ref
    assert ref["scales"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 14, 2.0 ** 14, 2.0 ** 14, 2.0 ** 15, 2.0 ** 15]
    for name, r in results[0].items():
        assert r["skipped"] == ref["skipped"] and r["scales"] == ref["scales"], (name, r)
        assert r["loss_rel"] < 2e-3, (name, r["losses"], ref["losses"])  # fp16 carries 11 bits
        assert r["param_rel"] < 1e-4, (name, r["param_rel"])
    results[1].pop("ref")
    assert results[1] == results[0]  # every rank reports the same steps, scales and losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_held_out_loss_every_n_steps_in_the_metrics(tmp_path):
    """Issue 32: --eval-data FILE --eval-every N: the held-out loss and perplexity after
    every N-th step and the last, in the step's metrics row, on the same batches each
    time (the first held-out loss is the one the plan's eval_step gives on them)."""
    import json

    from train_worlds import GPT_TINY, main_world, write_plan

    plan = write_plan(str(tmp_path / "dp2.json"), dp=2, zero=3, micro_batch_size=2)
    def phrase_file(name, n, seed):  # a repeated phrase with 10% noise: what is learnt carries over
        rng = np.random.default_rng(seed)
        ids = np.tile(np.array([3, 14, 15, 92, 65, 35, 89], dtype=np.uint16), n // 7 + 1)[:n]
        noise = rng.random(n) < 0.1
        ids[noise] = rng.integers(0, 128, noise.sum())
        ids.tofile(tmp_path / name)
        return str(tmp_path / name)
    train, held = phrase_file("train.bin", 4097, 0), phrase_file("held.bin", 2049, 5)
    metrics = tmp_path / "m.jsonl"
    argv = ["--data", train, "--eval-data", held, "--eval-every", "2", "--eval-batches", "2", "--steps", "5",
            "--lr", "3e-2", "--metrics", str(metrics), "--quiet"]
    assert run_world(main_world, 2, GPT_TINY, plan, argv, timeout=250) == [0, 0]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}
    assert sorted(evals) == [1, 3, 4]  # after steps 2 and 4, and the last (5)
    assert all(math.isfinite(v) and 0 < v < 10 for v in evals.values())
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in rows if "eval_loss" in r)
    assert evals[4] < evals[1]  # it learns, and the held-out loss says so


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_model_file_that_builds_on_the_meta_device_trains(tmp_path):
    """Issue 32: build_model() under `with torch.device("meta")` (as planning without
    weights recommends) left RMSNorm weights and RoPE tables without values ('the
    meta-built model's init left layers.0.attention_norm.weight unfilled', --init cpu
    too). The factory's meta tensors are made on the CPU while autopar loads it, so the
    constructor's values are kept and the job trains."""
    import json

    from train_worlds import main_world

    from autopar.lower.manual_plan import plan_for_model
    from llama import PRESETS, Llama, example_inputs
    from conftest import EXAMPLES

    model_file = tmp_path / "meta_llama.py"
    model_file.write_text(f"import sys, torch\nsys.path.insert(0, {str(EXAMPLES)!r})\nimport llama as L\n"
                          "def build_model():\n    with torch.device('meta'):\n"
                          "        return L.Llama(L.PRESETS['llama_tiny'])\n"
                          "def example_inputs(b):\n    return L.example_inputs(b, L.PRESETS['llama_tiny'])\n"
                          "loss_fn = L.loss_fn\n")
    plan = str(tmp_path / "plan.json")
    plan_for_model(Llama(PRESETS["llama_tiny"]), example_inputs=lambda b: example_inputs(b, PRESETS["llama_tiny"]),
                   dp=2, zero=3, micro_batch_size=2).save(plan)
    losses = tmp_path / "losses.json"
    argv = ["--synthetic", "--steps", "3", "--lr", "1e-2", "--losses-out", str(losses), "--quiet"]
    assert run_world(main_world, 2, str(model_file), plan, argv, timeout=250) == [0, 0]
    assert all(math.isfinite(x) for x in json.loads(losses.read_text()))


def test_progress_line_eta():
    """Issue 32: each step's line says how long the rest takes (median of recent steps)."""
    from autopar.train.run import _duration

    m = Metrics(_Plan())
    assert m.eta_s(10) is None
    for step, t in enumerate([5.0, 1.0, 1.2, 0.9]):
        m.record(step, loss=2.0, step_time_s=t)
    assert m.eta_s(10) == pytest.approx(11.0)  # median 1.1 s
    assert [_duration(x) for x in (41, 192, 7500)] == ["41s", "3m12s", "2h05m"]


def test_an_fp16_step_the_loss_scaler_skips_leaves_the_schedule_where_it_was(tmp_path):
    """Guards the mutation 'an fp16 step skipped by the loss scaler still advances the
    learning-rate schedule' (issue 35 item 4a). One process, gpt_tiny in fp16: a step whose
    gradients hold an Inf is skipped (weights unchanged, the scale halves), and the schedule's
    step count and the learning rate stay where they were, as Megatron and DeepSpeed do; the
    next clean step advances the schedule by one."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import gpt
    from autopar.lower import compile, plan_for_model

    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model, example = gpt.gpt_tiny()
        plan = plan_for_model(model, precision="fp16", micro_batch_size=2)
        pm = compile(model, example_inputs=example, loss_fn=gpt.loss_fn, plan=plan, optimizer=torch.optim.SGD,
                     optimizer_kwargs={"lr": 0.1})
        pm.grad_scaler.configure(init_scale=2.0 ** 4)  # no natural overflow at this scale
        pm.lr_scheduler = lr_scheduler(pm.optimizer, warmup=4, total=8, decay="linear")
        sync, poison = pm._sync_tied_grads, [True]

        def sync_then_poison():  # after backward, before the scaler unscales: one Inf in one gradient
            sync()
            if poison:
                local(next(p for p in pm.module.parameters() if p.grad is not None).grad).view(-1)[0] = math.inf

        pm._sync_tied_grads = sync_then_poison
        x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        weights = {n: local(p).detach().clone() for n, p in pm.module.named_parameters()}
        assert pm.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 4)  # warmup step 0
        pm.train_step((x,), x)
        assert pm.last_step_skipped and pm.grad_scaler.scale_value() == 2.0 ** 3
        assert pm.lr_scheduler.last_epoch == 0 and pm.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 4)
        assert all(torch.equal(local(p), weights[n]) for n, p in pm.module.named_parameters())
        poison.clear()
        pm.train_step((x,), x)
        assert not pm.last_step_skipped
        assert pm.lr_scheduler.last_epoch == 1 and pm.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 2 / 4)
        assert not all(torch.equal(local(p), weights[n]) for n, p in pm.module.named_parameters())
    finally:
        dist.destroy_process_group()


def test_metrics_rows_carry_each_prediction_from_its_own_field_of_the_plan(tmp_path):
    """Guards the mutation 'the metrics' predicted step time read from another field'
    (issue 35 item 4g): a real Plan whose predicted fields all differ; each row's predicted_*
    value is the plan's own field (peak memory: the fullest pp rank), and the measured MFU is
    the predicted MFU scaled by predicted over measured step time."""
    from autopar.plan import Plan, Predicted

    plan = Plan(global_batch_size=8, seq_len=128,
                predicted=Predicted(step_time_s=0.37, tokens_per_s=2768.0, samples_per_s=21.6, tflops_per_gpu=55.0,
                                    mfu=0.31, peak_memory_bytes=[2e9, 5e9], time_breakdown={"compute": 0.2}))
    path = tmp_path / "m.jsonl"
    m = Metrics(plan, path=str(path))
    m.record(0, loss=2.0, step_time_s=1.0)
    m.record(1, loss=1.9, step_time_s=0.5)
    row = json.loads(path.read_text().splitlines()[1])
    assert row["predicted_step_time_s"] == 0.37
    assert row["predicted_tokens_per_s"] == 2768.0 and row["predicted_mfu"] == 0.31
    assert row["predicted_peak_memory_bytes"] == 5e9
    assert row["tokens_per_s"] == pytest.approx(8 * 128 / 0.5) and row["mfu"] == pytest.approx(0.31 * 0.37 / 0.5)
    assert "0.37 s predicted" in m.summary()
