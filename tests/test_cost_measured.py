"""Measured profiles (cost_models/measured.py, `autopar calibrate`, `--profile`):
the tables reproduce what was measured, interpolate between points without
inventing trends, and the cost model prices with them; malformed files are
refused naming the field; the calibration itself runs on CPU + gloo."""
import copy
import json
import math
import subprocess
import sys

import pytest
from conftest import ROOT, benchmark_rows

from cost_models import comm as C
from cost_models.compute import op_times
from cost_models.errors import ProfileError
from cost_models.hardware import ClusterSpec
from cost_models.measured import SCHEMA, GemmGrid, MeasuredCollectives, Profile, ring_terms, time_for_size
from cost_models.workload import OpSpec

GPT = str(ROOT / "examples" / "gpt.py")


def _profile_dict(gemm_scale: float = 1.0, overlap: float = 1.0) -> dict:
    """A small, hand-made profile: GEMMs at 1e10 FLOP/s at the top of the grid and
    slower below, memory-bound ops at 1e10 B/s, 5 us per op, an alpha-beta gloo."""
    ms, nk = [16, 256, 4096], [16, 256]
    rates = [gemm_scale * 1e10 * (0.2 if (m < 256 or n < 256 or k < 256) else 1.0)
             for m in ms for n in nk for k in nk]
    sizes = [1e3, 1e5, 1e7]

    def ring(kind, n, alpha=50e-6, bw=1e9):
        steps, factor = ring_terms(kind, n)
        return {"bytes": sizes, "seconds": [steps * alpha + factor * s / bw for s in sizes]}

    return {
        "schema": SCHEMA, "machine": {"host": "test"}, "device_name": "measured-test",
        "device": {"vendor": "cpu", "peak_tflops": {"fp32": 0.01}, "memory_gib": 8, "memory_bandwidth_tbs": 0.01,
                   "memory_efficiency": 1.0, "reserve_gib": 0.5, "num_sms": 1, "gemm_max_efficiency": 1.0,
                   "kernel_launch_us": 5.0, "collective_overlap": overlap},
        "compute": {"gemm": {"fp32": {"m": ms, "n": nk, "k": nk, "flops_per_s": rates}},
                    "bandwidth": {c: {"bytes": sizes, "bytes_per_s": [5e9, 1e10, 1e10]}
                                  for c in ("elementwise", "norm", "softmax", "copy", "embedding")},
                    "attention": [{"causal": c, "direction": d, "flops": [1e6, 1e9], "flops_per_s": [1e9, 5e9]}
                                  for c in (True, False) for d in ("fwd", "bwd")],
                    "op_overhead_fwd_s": 8e-6, "op_overhead_bwd_s": 6e-6, "op_overhead_no_grad_s": 5e-6},
        "collectives": {"intra_node": {"all_reduce": {"2": ring("all_reduce", 2), "4": ring("all_reduce", 4)},
                                       "all_gather": {"2": ring("all_gather", 2)},
                                       "reduce_scatter": {"2": ring("reduce_scatter", 2)},
                                       "p2p": {"2": ring("p2p", 2)}}},
    }


def _cluster(d=None, gpus=4) -> ClusterSpec:
    return ClusterSpec(gpus=gpus, device="cpu", gpus_per_node=gpus).with_profile(Profile.from_dict(d or _profile_dict()))


# -- tables ------------------------------------------------------------------------------
def test_gemm_grid_reproduces_points_and_floors_below():
    grid = GemmGrid((16, 256), (16, 256), (16, 256), tuple(1e9 * (i + 1) for i in range(8)))
    for i, m in enumerate((16, 256)):
        for j, n in enumerate((16, 256)):
            for k_, k in enumerate((16, 256)):
                rate = 1e9 * (i * 4 + j * 2 + k_ + 1)
                assert grid.time(m, n, k) == pytest.approx(2 * m * n * k / rate)
    # between points: the rate lies between its neighbours'
    assert 1e9 < grid.rate(64, 16, 16) < 5e9
    # below the grid: never faster than the smallest measured GEMM
    assert grid.time(1, 16, 16) == pytest.approx(grid.time(16, 16, 16))
    # above: the largest size's rate, time grows with the work
    assert grid.time(1024, 256, 256) == pytest.approx(2 * 1024 * 256 * 256 / 8e9)


def test_time_for_size_floor_and_extension():
    sizes, rates = (1e3, 1e6), (1e9, 1e10)
    assert time_for_size(sizes, rates, 10) == pytest.approx(1e3 / 1e9)  # floor
    assert time_for_size(sizes, rates, 1e6) == pytest.approx(1e-4)
    assert time_for_size(sizes, rates, 4e6) == pytest.approx(4e-4)  # the largest size's rate
    mid = time_for_size(sizes, rates, 3e4)
    assert 3e4 / 1e10 < mid < 3e4 / 1e9


def test_collectives_measured_exact_and_unmeasured_groups_follow_the_ring():
    coll = _cluster().intra_link.measured
    assert isinstance(coll, MeasuredCollectives)
    assert coll.time("all_reduce", 2, 1e5) == pytest.approx(2 * 50e-6 + 1e5 / 1e9)
    alpha, bw = coll.fit("all_reduce")  # fitted to the largest group (4), synthetic alpha-beta data
    assert alpha == pytest.approx(50e-6, rel=1e-6) and bw == pytest.approx(1e9, rel=1e-6)
    steps, factor = ring_terms("all_reduce", 8)
    assert coll.time("all_reduce", 8, 1e6) == pytest.approx(steps * 50e-6 + factor * 1e6 / 1e9, rel=1e-6)
    assert coll.time("broadcast", 2, 1e6) is None  # not measured and no group of its kind: physics decides


# -- the cost model reads them -----------------------------------------------------------------
def test_op_times_use_the_tables_and_layers_pay_host_time_per_op():
    from cost_models.compute import host_times
    from cost_models.workload import LayerSpec

    cluster = _cluster()
    device = cluster.device_profile
    gemm = OpSpec(name="fc:mm", kind="gemm", fwd_flops=2 * 256 * 256 * 256, bwd_flops=4 * 256 ** 3,
                  fwd_bytes=0, bwd_bytes=0, gemm=(256, 256, 256), count=1)
    f, b = op_times(gemm, 1, 1, device, dtype="fp32")
    one = 2 * 256 ** 3 / 1e10
    assert f == pytest.approx(one) and b == pytest.approx(2 * one)  # the work alone
    # with a bias (addmm), the output is written twice more forward and summed backward
    biased = OpSpec(**{**vars(gemm), "name": "fc:addmm"})
    fb, bb = op_times(biased, 1, 1, device, dtype="fp32")
    out_bytes = 256 * 256 * 4
    assert fb == pytest.approx(one + time_for_size((1e3, 1e5, 1e7), (5e9, 1e10, 1e10), 2 * out_bytes))
    assert bb == pytest.approx(2 * one + time_for_size((1e3, 1e5, 1e7), (5e9, 1e10, 1e10), out_bytes))
    # three identical calls folded into one entry: three calls of a third of the bytes each
    norm = OpSpec(name="ln:native_layer_norm", kind="norm", fwd_bytes=3e3, bwd_bytes=3e3, count=3)
    f, _ = op_times(norm, 1, 1, device, dtype="fp32")
    assert f == pytest.approx(3 * time_for_size((1e3, 1e5, 1e7), (5e9, 1e10, 1e10), 1e3))
    # a slower machine's table makes the same op slower, by the table's ratio
    f_slow, _ = op_times(gemm, 1, 1, _cluster(_profile_dict(gemm_scale=0.5)).device_profile, dtype="fp32")
    assert f_slow == pytest.approx(2 * one)
    # host time: every op the layer dispatches (capture's count, views included)
    layer = LayerSpec(name="b", kind="transformer_block", params=10, param_bytes=40, fwd_flops=0, bwd_flops=0,
                      activation_bytes=0, output_bytes=0, ops=[gemm, norm],
                      attrs={"host_ops_fwd": 30, "host_ops_bwd": 80})
    assert host_times(layer, device, dtensor=False) == pytest.approx((30 * 8e-6, 80 * 6e-6))


def test_collective_time_and_p2p_use_the_measured_link():
    cluster = _cluster()
    place = C.group_placement("dp", 1, 4, 1, cluster)
    assert C.collective_time("all_reduce", 1e7, place, cluster) == pytest.approx(6 * 50e-6 + 1.5 * 1e7 / 1e9)
    assert C.p2p_time(1e5, True, cluster) == pytest.approx(50e-6 + 1e5 / 1e9)


def test_collective_overlap_zero_exposes_all_dp_traffic():
    from cost_models.analytic import gpt
    from cost_models.estimate import estimate
    from cost_models.layout import Layout

    model = gpt("g", hidden=256, heads=4, layers=2, seq_len=128, vocab_size=1024)
    layout = Layout(dp=4, zero=0, micro_batch_size=1, num_micro_batches=2, precision="fp32")
    hidden_est = estimate(model, layout, _cluster(_profile_dict(overlap=1.0)))
    exposed_est = estimate(model, layout, _cluster(_profile_dict(overlap=0.0)))
    tb = exposed_est.time_breakdown
    assert tb["dp_comm_exposed_s"] >= tb["dp_comm_s"]  # every collective exposed (and DDP's bucket copies)
    assert hidden_est.time_breakdown["dp_comm_exposed_s"] < tb["dp_comm_exposed_s"]


def test_pipeline_action_time_adds_to_every_forward_and_backward_on_a_cpu():
    """A measured per-action host time of the pipeline runtime: on a CPU every
    stage's forward and backward of every micro-batch pays it, so a 1F1B step over
    2 ranks and m micro-batches grows by at least 2 m actions (the last rank's);
    pp = 1 does not run the schedule and pays nothing."""
    from cost_models.analytic import gpt
    from cost_models.estimate import estimate
    from cost_models.layout import Layout

    model = gpt("g", hidden=256, heads=4, layers=4, seq_len=128, vocab_size=1024)
    with_action = _profile_dict()
    with_action["compute"]["pipeline_action_s"] = 1e-3
    m = 4
    pp2 = Layout(pp=2, micro_batch_size=1, num_micro_batches=m, schedule="1f1b", precision="fp32")
    base, paid = (estimate(model, pp2, _cluster(d, gpus=2)).step_time_s for d in (_profile_dict(), with_action))
    assert 2 * m * 1e-3 <= paid - base <= (2 * m + 2) * 1e-3 + 1e-9  # each rank's 2m actions, plus the fill and drain
    one = Layout(pp=1, dp=2, micro_batch_size=1, num_micro_batches=m, precision="fp32")
    assert estimate(model, one, _cluster(with_action, gpus=2)).step_time_s == \
        pytest.approx(estimate(model, one, _cluster(gpus=2)).step_time_s)


def test_measured_fsdp_units_and_dtensor_optimizer_price_zero3():
    """ZeRO-3 on a calibrated machine: each unit costs what FSDP2 was timed to cost per
    all-gather and reduce-scatter (collectives included at the group size timed), and
    the optimizer steps DTensor shards at the DTensor rate."""
    from cost_models.analytic import gpt
    from cost_models.estimate import layer_cost
    from cost_models.layout import Layout

    base = _profile_dict(overlap=0.0)
    timed = copy.deepcopy(base)
    timed["compute"]["fsdp"] = {"ranks": 2, "unit_bytes": [1e3, 1e7], "gather_s": [1e-3, 1e-2],
                                "reduce_s": [2e-3, 2e-2]}
    timed["compute"]["optimizer"] = {"adam": {"per_step_s": 0, "per_tensor_s": 1e-5, "per_param_s": 1e-9},
                                     "adam:dtensor": {"per_step_s": 0, "per_tensor_s": 1e-4, "per_param_s": 1e-9}}
    model = gpt("g", hidden=256, heads=4, layers=2, seq_len=64, vocab_size=512)
    layer = model.layers[1]
    layout = Layout(dp=2, zero=3, micro_batch_size=1, precision="fp32")
    cluster = _cluster(timed, gpus=2)
    lc = layer_cost(layer, model, layout, cluster)
    unit_bytes = layer.params * 4
    gather = 1e-3 + (1e-2 - 1e-3) * (unit_bytes - 1e3) / (1e7 - 1e3)
    reduce = 2e-3 + (2e-2 - 2e-3) * (unit_bytes - 1e3) / (1e7 - 1e3)
    # nothing hides on this machine (overlap 0): two gathers (forward, backward) and one reduce-scatter
    assert lc.dp_comm_exposed_s == pytest.approx(2 * gather + reduce, rel=1e-6)
    tensors = layer.attrs["param_tensors"]
    assert lc.optimizer_s == pytest.approx(1e-4 * tensors + 1e-9 * layer.params / 2)
    # without the FSDP table the physics prices the collectives and FSDP2's copies instead
    plain = layer_cost(layer, model, layout, _cluster(base, gpus=2))
    assert plain.dp_comm_exposed_s != pytest.approx(lc.dp_comm_exposed_s)


def test_profile_survives_a_plan_file_round_trip():
    from cost_models.analytic import gpt
    from cost_models.estimate import estimate
    from cost_models.layout import Layout

    cluster = _cluster()
    again = ClusterSpec.from_dict(json.loads(json.dumps(cluster.to_dict())))
    assert again.cache_key() == cluster.cache_key()
    model = gpt("g", hidden=128, heads=4, layers=2, seq_len=64, vocab_size=512)
    layout = Layout(dp=2, zero=3, micro_batch_size=2, precision="fp32")
    assert estimate(model, layout, again).step_time_s == estimate(model, layout, cluster).step_time_s
    assert cluster.nodes == 1 and cluster.gpus_per_node == 4 and cluster.device == "measured-test"


def test_median_profile_takes_every_measurement_s_median():
    """Several calibrations of one machine (`autopar calibrate --runs N`, the CPU
    benchmark's one per round): every number the median of its runs, so one run in a
    slow spell moves nothing; the plan priced with it sits between the runs'."""
    from cost_models.analytic import gpt
    from cost_models.estimate import estimate
    from cost_models.layout import Layout
    from cost_models.measured import median_profile

    runs = [Profile.from_dict(_profile_dict(gemm_scale=s)) for s in (1.0, 0.5, 0.9)]  # one slow spell
    merged = median_profile(runs)
    d = merged.to_dict()
    assert d["compute"]["gemm"]["fp32"]["flops_per_s"] == runs[2].to_dict()["compute"]["gemm"]["fp32"]["flops_per_s"]
    assert d["compute"]["gemm"]["fp32"]["m"] == [16, 256, 4096]  # the grid itself unchanged
    assert d["machine"]["calibrations"] == 3
    model = gpt("g", hidden=128, heads=4, layers=2, seq_len=64, vocab_size=512)
    layout = Layout(dp=2, zero=3, micro_batch_size=2, precision="fp32")

    def step(p):
        return estimate(model, layout, ClusterSpec(gpus=4, device="cpu", gpus_per_node=4).with_profile(p)).step_time_s
    assert step(runs[0]) < step(merged) < step(runs[1])
    assert step(merged) == step(runs[2])
    assert median_profile(runs[:1]).to_dict()["compute"] == runs[0].to_dict()["compute"]


def test_attention_is_priced_at_its_sequence_length_when_the_table_records_it():
    """A calibration times SDPA on one sequence of a few heads; a training call runs
    micro-batch x heads of them. With `seq` recorded, a call is priced at the rate
    measured at its own sequence length, whatever its total FLOPs: 16 sequences of
    64 are not priced at the rate of one sequence of 256 with the same FLOPs. A table
    without `seq` (older profiles, the committed H100 one) keeps the FLOPs lookup."""
    d = _profile_dict()
    for a in d["compute"]["attention"]:
        a.update(flops=[1e6, 1e9], flops_per_s=[1e9, 4e9], seq=[64.0, 256.0])
    meas = Profile.from_dict(d).compute
    flops = 1e9  # the 256-long point's FLOPs, run as many 64-long sequences
    assert meas.attention_time(flops, True, "fwd", "fp32", seq=64) == pytest.approx(flops / 1e9)
    assert meas.attention_time(flops, True, "fwd", "fp32", seq=256) == pytest.approx(flops / 4e9)
    assert meas.attention_time(flops, True, "fwd", "fp32", seq=128) == pytest.approx(flops / 2e9)  # log-log
    assert meas.attention_time(flops, True, "fwd", "fp32") == pytest.approx(flops / 4e9)  # no seq: by FLOPs
    assert Profile.from_dict(d).to_dict()["compute"]["attention"][0]["seq"] == [64.0, 256.0]  # round trip
    old = Profile.from_dict(_profile_dict()).compute
    assert old.attention_time(flops, True, "fwd", "fp32", seq=64) == old.attention_time(flops, True, "fwd", "fp32")
    bad = copy.deepcopy(d)
    bad["compute"]["attention"][0]["seq"] = [64.0]
    with pytest.raises(ProfileError) as err:
        Profile.from_dict(bad)
    assert "compute.attention[0].seq" in str(err.value)


def test_backward_bytes_read_the_backward_table_first():
    """A memory-bound op's backward is its own kernel (gelu's evaluates the derivative):
    a profile's `NAME.bwd` table prices it, else the class's `.bwd`, else the forward
    tables as before; the forward never reads a backward table."""
    d = _profile_dict()
    bw = d["compute"]["bandwidth"]
    bw["gelu"] = {"bytes": [1e3, 1e7], "bytes_per_s": [1e9, 1e9]}
    bw["gelu.bwd"] = {"bytes": [1e3, 1e7], "bytes_per_s": [4e9, 4e9]}
    bw["norm.bwd"] = {"bytes": [1e3, 1e7], "bytes_per_s": [2e9, 2e9]}
    meas = Profile.from_dict(d).compute
    assert meas.bytes_time("elementwise", 1e6, "gelu") == pytest.approx(1e6 / 1e9)
    assert meas.bytes_time("elementwise", 1e6, "gelu", direction="bwd") == pytest.approx(1e6 / 4e9)
    assert meas.bytes_time("norm", 1e6, "rms_norm", direction="bwd") == pytest.approx(1e6 / 2e9)  # its class's
    assert meas.bytes_time("elementwise", 1e6, "silu", direction="bwd") == pytest.approx(1e6 / 1e10)  # forward's
    assert Profile.from_dict(d).to_dict()["compute"]["bandwidth"]["gelu.bwd"]["bytes_per_s"] == [4e9, 4e9]
    op = OpSpec(name="mlp:gelu", kind="elementwise", fwd_bytes=1e6, bwd_bytes=1.5e6)
    cluster = ClusterSpec(gpus=4, device="cpu", gpus_per_node=4).with_profile(Profile.from_dict(d))
    f, b = op_times(op, 1, 1, cluster.device_profile, dtype="fp32")
    assert f == pytest.approx(1e6 / 1e9) and b == pytest.approx(1.5e6 / 4e9)


def test_dtensor_time_per_op_is_read_at_the_layer_s_activation_size():
    """A profile that timed DTensor's cost per op by activation size prices a
    tensor-parallel layer at the bytes its blocks carry: the measured points exactly,
    linear between them, the nearest end outside (never extrapolated); without the
    table, the host-only scalars at every size. Eager layers never read it."""
    from cost_models.compute import host_times
    from cost_models.workload import LayerSpec

    d = _profile_dict()
    d["compute"].update(dtensor_overhead_fwd_s=20e-6, dtensor_overhead_bwd_s=15e-6)
    plain = Profile.from_dict(d).compute
    assert plain.dtensor_op_s(1e9) == (20e-6, 15e-6)
    d["compute"]["dtensor_by_activation"] = {"bytes": [256, 1e5, 1e6], "fwd_s": [20e-6, 30e-6, 50e-6],
                                             "bwd_s": [15e-6, 25e-6, 45e-6]}
    meas = Profile.from_dict(d).compute
    assert meas.dtensor_op_s(1e5) == pytest.approx((30e-6, 25e-6))
    assert meas.dtensor_op_s(5.5e5) == pytest.approx((40e-6, 35e-6))  # halfway
    assert meas.dtensor_op_s(1e9) == pytest.approx((50e-6, 45e-6))  # clamped at the largest size timed
    assert meas.dtensor_op_s(0) == pytest.approx((20e-6, 15e-6))
    assert Profile.from_dict(Profile.from_dict(d).to_dict()).compute.dtensor_by_activation == \
        meas.dtensor_by_activation  # survives the file
    layer = LayerSpec(name="b", kind="transformer_block", params=10, param_bytes=40, fwd_flops=0, bwd_flops=0,
                      activation_bytes=0, output_bytes=0, ops=[], attrs={"host_ops_fwd": 30, "host_ops_bwd": 80})
    device = _cluster(d).device_profile
    assert host_times(layer, device, dtensor=True, activation_bytes=1e6) == pytest.approx((30 * 50e-6, 80 * 45e-6))
    assert host_times(layer, device, dtensor=False, activation_bytes=1e6) == pytest.approx((30 * 8e-6, 80 * 6e-6))
    d["compute"]["dtensor_by_activation"]["bytes"] = [256, 1e6, 1e5]
    with pytest.raises(ProfileError, match="dtensor_by_activation.bytes"):
        Profile.from_dict(d)


def test_memory_bound_calibration_writes_results_to_cold_buffers():
    """calibrate's memory-bound ops keep their last results alive, so every call writes
    a buffer last touched many calls ago (as a step's outputs land in memory freed long
    before), never the buffer it just freed, which is still in the core's cache."""
    import torch

    from autopar.calibrate.timing import _copies, _cycling

    keep = _copies(4 * 2**20, torch.device("cpu"))
    assert keep == 32  # 128 MiB of 4 MiB results: beyond the caches a step overflows
    operands = [(torch.ones(8),), (torch.ones(8) * 2,)]
    call = _cycling(lambda x: x * 3, operands, keep=keep)
    outs = [call() for _ in range(keep)]
    # every result of the last `keep` calls is alive at once: distinct buffers
    assert len({o.data_ptr() for o in outs}) == keep
    assert sorted({float(o[0]) for o in outs}) == [3.0, 6.0]  # the operands in turn


def test_speed_probe_times_fixed_work_and_the_median_profile_keeps_its_median():
    """The probe is the same work on every call (it reads the machine's pace, not a
    model's); a profile keeps the pace it was measured at, and the median of several
    calibrations keeps the median pace."""
    from autopar.calibrate import speed_probe
    from cost_models.measured import median_profile

    t = speed_probe(samples=3)
    assert 1e-5 < t < 1.0
    runs = []
    for probe in (0.004, 0.006, 0.005):
        d = _profile_dict()
        d["machine"]["speed_probe_s"] = probe
        runs.append(Profile.from_dict(d))
    assert median_profile(runs).machine["speed_probe_s"] == 0.005


# -- malformed files ----------------------------------------------------------------------------
@pytest.mark.parametrize("edit, field", [
    (lambda d: d.update(schema="autopar-profile/0"), "schema"),
    (lambda d: d["compute"]["gemm"]["fp32"]["flops_per_s"].pop(), "compute.gemm.fp32.flops_per_s"),
    (lambda d: d["compute"]["bandwidth"]["norm"].update(bytes=[1e5, 1e3, 1e7]), "compute.bandwidth.norm.bytes"),
    (lambda d: d["collectives"]["intra_node"]["all_reduce"]["2"]["seconds"].__setitem__(0, -1),
     "collectives.intra_node.all_reduce.2.seconds"),
    (lambda d: d["collectives"]["intra_node"].update(allreduce={}), "collectives.intra_node.allreduce"),
    (lambda d: d["device"].update(collective_overlap=1.5), "devices.measured-test.collective_overlap"),
])
def test_malformed_profile_names_the_field(tmp_path, edit, field):
    d = copy.deepcopy(_profile_dict())
    edit(d)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ProfileError) as err:
        Profile.load(str(path))
    assert f"'{field}'" in str(err.value) and str(path) in str(err.value)


def test_cli_profile_errors_are_one_line(tmp_path, capsys):
    from autopar.cli import main

    code = main(["plan", f"{GPT}:gpt_tiny", "--gpus", "2", "--device", "cpu", "--profile", str(tmp_path / "no.json")])
    err = capsys.readouterr().err
    assert code == 2 and "--profile" in err and "autopar calibrate" in err and "Traceback" not in err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code = main(["plan", f"{GPT}:gpt_tiny", "--gpus", "2", "--device", "cpu", "--profile", str(bad)])
    err = capsys.readouterr().err
    assert code == 2 and "not valid JSON" in err and "Traceback" not in err


# -- the calibration itself ---------------------------------------------------------------------
@pytest.mark.slow
def test_calibrate_one_rank_times_compute_only(tmp_path):
    """One GPU (or one process) has no collectives to time: the profile holds the
    compute tables, and planning on more ranks prices collectives by link physics."""
    out = tmp_path / "one.json"
    proc = subprocess.run([sys.executable, "-m", "autopar", "calibrate", "--quick", "--ranks", "1",
                           "--dtypes", "fp32", "-o", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = Profile.load(str(out))
    assert profile.collectives == {} and profile.compute.gemm and profile.compute.optimizer
    cluster = ClusterSpec(gpus=2, device="cpu", gpus_per_node=2).with_profile(profile)
    assert cluster.intra_link.measured is None  # the link's physics prices the collectives
    place = C.group_placement("dp", 1, 2, 1, cluster)
    assert C.collective_time("all_reduce", 1e6, place, cluster) > 0


@pytest.fixture(scope="module")
def quick_cpu_profile(tmp_path_factory):
    """`autopar calibrate --quick` on 2 gloo ranks, once for the tests below (a calibration
    is most of a minute on 2 cores)."""
    out = tmp_path_factory.mktemp("calibrated") / "cpu.json"
    proc = subprocess.run([sys.executable, "-m", "autopar", "calibrate", "--quick", "--ranks", "2",
                           "--threads-per-rank", "1", "--dtypes", "fp32", "-o", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_calibrate_then_plan_with_the_profile(quick_cpu_profile):
    """`autopar calibrate --quick` on 2 gloo ranks writes a profile whose numbers
    are physical, and `autopar plan --profile` prices with it."""
    out = quick_cpu_profile
    profile = Profile.load(str(out))
    assert 1e8 < profile.device["peak_tflops"]["fp32"] * 1e12 < 1e13  # 0.1 GFLOP/s .. 10 TFLOP/s on one core
    assert 1e-7 < profile.compute.op_overhead_fwd_s < 1e-3
    # DTensor's sharding propagation and the TP styles' hooks are host work on top of each eager op
    assert profile.compute.dtensor_overhead_fwd_s > profile.compute.op_overhead_fwd_s
    # ... and timed again on blocks carrying real data (one size when quick), per op
    sizes, fwd, bwd = profile.compute.dtensor_by_activation
    assert sizes[0] < sizes[-1] and all(t > profile.compute.op_overhead_fwd_s for t in fwd)
    assert profile.compute.dtensor_collective_overhead_s >= 0
    assert 0 < profile.compute.pipeline_action_s < 0.1  # the pipeline runtime's host time per action
    coll = profile.collectives["intra_node"]
    t_small, t_big = coll.time("all_reduce", 2, 1024), coll.time("all_reduce", 2, 2**22)
    assert 0 < t_small < t_big  # a bigger message takes longer
    assert 0.0 <= profile.device["collective_overlap"] <= 1.0
    plan = subprocess.run([sys.executable, "-m", "autopar", "plan", f"{GPT}:gpt_tiny", "--gpus", "2", "--device",
                           "cpu", "--profile", str(out), "--precision", "fp32", "--batch-size", "8", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert plan.returncode == 0, plan.stderr[-3000:]
    data = json.loads(plan.stdout)
    assert data["cluster"]["device"] == "measured-cpu"
    assert "measured" in data["cluster"]["devices"]["measured-cpu"]
    assert math.isfinite(data["predicted"]["step_time_s"]) and data["predicted"]["step_time_s"] > 0


@pytest.mark.slow
def test_cpu_step_time_benchmark_runs_end_to_end(tmp_path, quick_cpu_profile):
    """benchmarks/cpu_step_time.py --quick --profile: plan with a quick calibration of this
    machine (the fixture's; the benchmark's own calibrations between rounds and their median
    are test_median_profile_takes_every_measurement_s_median's and the committed table's),
    train on 2 gloo ranks in two rounds, compare. Loose bounds (a shared CI machine is noisy; the committed
    table, benchmarks/results/cpu_step_time.md, is the measurement): every case is
    priced and run, step time within a factor of 2, peak memory within 50%."""
    out = tmp_path / "cst"
    proc = subprocess.run([sys.executable, "benchmarks/cpu_step_time.py", "--quick", "--profile", str(quick_cpu_profile),
                           "--rounds", "2", "--steps", "3", "--warmup", "2", "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "cst.json").read_text())
    assert data["summary"]["priced_and_run"] == data["summary"]["cases"] == 2
    assert data["machine"]["speed_probe_s"] > 0  # the calibrations' pace, which the rows are scaled to
    for row in data["rows"]:
        assert 0.5 < row["predicted_s"] / row["measured_s"] < 2.0, row
        assert len(row["speed_probe_rounds_s"]) == 2 and 0.5 < row["pace"] < 2.0, row
        assert row["measured_s"] == pytest.approx(row["measured_raw_s"] * 1 / row["pace"], rel=0.3)
        assert abs(row["memory_error"]) < 0.5, row
    assert (tmp_path / "cst.md").read_text().count("| gpt_") == 2
    assert all(len(r["measured_rounds_s"]) == 2 for r in data["rows"])


@pytest.mark.slow
def test_memory_tracker_benchmark_agrees_with_fsdp_mem_tracker(tmp_path):
    """benchmarks/memory_tracker.py on eight layouts at real size (Llama 3 8B and 70B,
    GPT-3 6.7B widths; ZeRO-2 and 3; no, selective and full checkpointing; seq 2048 to
    8192; bf16 and fp32 reduction): the plan's peak (less fragmentation) against torch's
    FSDPMemTracker under fake tensors, within 5% each, and FSDP2's persistent sharded
    states (fp32 parameter shards + AdamW moments) exactly as booked. Their peaks fall
    at different moments: the loss's first backward op, the LM head's weight gradient,
    a block's reduce-scatter, the tied embedding's gradient held by the root unit, a
    block's MLP gradients beside its attention's recomputed activations (the layer's
    backward walk), the grouped head unit's all-gather buffer.
    The committed table (benchmarks/results/memory_tracker.md) has all 24."""
    out = tmp_path / "mt"
    # one case per moment the peak falls at (the docstring's list), each level and policy
    # at least once; the other sixteen are in the committed table, not re-run here
    cases = ["llama3_8b_l4_s2048_z3_none", "llama3_8b_l4_s8192_z3_full",
             "llama3_70b_l2_s4096_z2_full", "llama3_70b_l2_s4096_z3_none", "llama3_70b_l2_s4096_z3_selective",
             "gpt3_6.7b_l4_s2048_z2_selective", "gpt3_6.7b_l4_s2048_z3_full",
             "llama3_8b_l4_s2048_z3_none_fp32reduce"]
    rows = benchmark_rows("memory_tracker.py", cases, out)
    for row in rows:
        assert row["tracked_bytes"] > 3.5 * 2 ** 30  # a real-size rank, not a toy
        assert abs(row["error"]) < 0.05, (row["case"], row["error"])
        assert row["tracked_sharded_states"] == pytest.approx(row["predicted_sharded_states"], rel=0.01), row["case"]


def test_calibrate_work_time_on_a_cpu_is_the_call_less_its_dispatch():
    """On a CPU the host dispatches and then computes: a call's work is its time less the
    dispatch time the cost model charges apart per op, never under a tenth of it."""
    import torch

    from autopar import calibrate as cal

    class FixedTimer(cal.Timer):
        def __call__(self, fn, inner=None):
            return 1e-3

    timer = FixedTimer(cal.Settings(device="cpu"), torch.device("cpu"))
    assert cal.timing._work_seconds(timer, lambda: None, 2e-4) == pytest.approx(8e-4)
    assert cal.timing._work_seconds(timer, lambda: None, 5e-3) == pytest.approx(1e-4)
    assert cal.timing._work_rate(8.0, timer, lambda: None, 2e-4) == pytest.approx(1e4)


def _cuda():
    import torch
    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="a GPU's kernel timing (run on a lent GPU: benchmarks/gpu_run.sh)")
def test_calibrate_gpu_kernel_time_excludes_the_overlapped_launch():
    """On a GPU the kernels run while the host launches the next call: a memory-bound
    op too small to outlast its launch must be timed at its kernels' own speed, never
    faster than the HBM streams (the host-time subtraction priced a 33 MB gelu at
    30 TB/s on a 4.8 TB/s H200), and the large sizes at the same speed as before."""
    import torch

    from autopar import calibrate as cal

    dev = torch.device("cuda")
    settings = cal.Settings(device="cuda")
    timer = cal.Timer(settings, dev)
    over = cal.measure_overhead(timer, dev)
    g = {**cal.grids(settings), "elements": [2**18, 2**22, 2**26]}
    table = cal.measure_ops(timer, dev, g, over["no_grad"], lambda msg: None)
    for name in ("add", "gelu", "copy"):
        streaming = table[name]["bytes_per_s"][-1]  # far beyond L2: HBM's own rate
        assert max(table[name]["bytes_per_s"]) <= 1.15 * streaming, (name, table[name])
    # a tiny op's kernel is shorter than its launch: timed alone it is the launch
    x = torch.randn(1024, device=dev)
    assert timer.kernel(lambda: x + x) < timer(lambda: x + x)
