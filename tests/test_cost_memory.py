"""Memory model: ZeRO model states, Korthikanti activations, in-flight micro-batches."""
import pytest

from cost_models.analytic import block, gpt
from cost_models.estimate import estimate
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout
from cost_models.memory import activation_bytes, in_flight_micro_batches, model_state_bytes
from cost_models.pipeline import simulate


def test_zero_paper_example_exact_to_printed_digits():
    # ZeRO paper Fig. 1: Psi = 7.5B, N_d = 64, mixed-precision Adam (K = 12), 1 GB = 1e9 B
    printed = {0: "120", 1: "31.4", 2: "16.6", 3: "1.9"}
    for zero, text in printed.items():
        st = model_state_bytes(7.5e9, precision="bf16", optimizer="adam", zero=zero, dp=64)
        gb = (st.params + st.grads + st.optimizer) / 1e9
        digits = len(text.split(".")[1]) if "." in text else 0
        assert f"{gb:.{digits}f}" == text, (zero, gb)


def test_precision_optimizer_and_offload():
    fp32 = model_state_bytes(1e9, precision="fp32", optimizer="adam")
    assert (fp32.params, fp32.grads, fp32.optimizer) == (4e9, 4e9, 8e9)
    sgd = model_state_bytes(1e9, precision="bf16", optimizer="sgd")
    assert sgd.optimizer == 8e9
    off = model_state_bytes(1e9, zero=1, dp=4, offload="optimizer")
    assert off.optimizer == 0 and off.host == pytest.approx(12e9 / 4)
    offp = model_state_bytes(1e9, zero=3, dp=4, offload="params")
    assert offp.params == offp.grads == offp.optimizer == 0 and offp.host == pytest.approx(16e9 / 4)


# Korthikanti et al. 2022 (bytes per layer, 16-bit activations, with dropout, no FlashAttention)
S_, B_, H_, A_ = 2048, 4, 6144, 64


def _korthikanti(t, variant):
    s, b, h, a = S_, B_, H_, A_
    return {
        "none": s * b * h * (34 + 5 * a * s / h),
        "tp": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": s * b * h / t * (34 + 5 * a * s / h),
        "tp+sp+selective": 34 * s * b * h / t,
        "full": 2 * s * b * h,
    }[variant]


@pytest.mark.parametrize("t, variant, sp, ckpt", [
    (1, "none", False, "none"), (8, "tp", False, "none"), (4, "tp", False, "none"),
    (8, "tp+sp", True, "none"), (8, "tp+sp+selective", True, "selective"), (1, "full", False, "full"),
])
def test_korthikanti_activation_formulas_within_5pct(t, variant, sp, ckpt):
    layer = block(0, hidden=H_, heads=A_, ffn_hidden=4 * H_, dropout=True, attention="unfused")
    got = activation_bytes(layer, B_, S_, tp=t, sequence_parallel=sp, checkpoint=ckpt)
    assert got == pytest.approx(_korthikanti(t, variant), rel=0.05)


def test_flash_attention_drops_the_s_squared_term():
    flash = block(0, hidden=H_, heads=A_, ffn_hidden=4 * H_, dropout=True, attention="flash")
    unfused = block(0, hidden=H_, heads=A_, ffn_hidden=4 * H_, dropout=True, attention="unfused")
    f = activation_bytes(flash, B_, S_)
    assert f < 0.5 * activation_bytes(unfused, B_, S_)
    assert f == pytest.approx(34 * S_ * B_ * H_, rel=0.05)  # only the s b h terms remain (plus the lse rows)


@pytest.mark.parametrize("schedule, p, m, v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1),
                                              ("interleaved", 4, 8, 2), ("interleaved", 8, 16, 4)])
def test_simulated_in_flight_matches_closed_forms(schedule, p, m, v):
    n = p * v
    res = simulate(schedule, p, m, [1.0 / v] * n, [2.0 / v] * n, virtual_stages=v)
    for r in range(p):
        assert res.peak_in_flight[r] == pytest.approx(in_flight_micro_batches(schedule, p, m, r, v))
    if schedule == "interleaved":  # Korthikanti: p (1 + (p-1)/(p V)) on the first rank
        assert res.peak_in_flight[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_checkpointing_trades_time_for_memory():
    model = gpt("g", hidden=4096, heads=32, layers=8, seq_len=2048, vocab_size=51200, attention="unfused")
    cluster = ClusterSpec.preset("dgx-a100")
    res = {c: estimate(model, Layout(tp=8, micro_batch_size=4, num_micro_batches=4, checkpoint=c), cluster)
           for c in ("none", "selective", "full")}
    mem = {c: r.memory_breakdown[0]["activations"] for c, r in res.items()}
    time = {c: r.step_time_s for c, r in res.items()}
    assert mem["full"] < mem["selective"] < mem["none"]
    assert time["none"] < time["selective"] < time["full"]
    # full recomputation costs about one more forward: 4/3 of the compute at most
    assert time["full"] / time["none"] < 1.40


def test_fits_flag_and_reason():
    model = gpt("big", hidden=12288, heads=96, layers=96, seq_len=2048, vocab_size=50257)
    est = estimate(model, Layout(dp=8, micro_batch_size=1), ClusterSpec.preset("dgx-a100"))
    assert not est.fits and "GiB" in est.why_not_fit
    est = estimate(model, Layout(tp=8, pp=8, dp=2, micro_batch_size=1, num_micro_batches=16, zero=1,
                                 checkpoint="full"), ClusterSpec.preset("dgx-a100", nodes=16))
    assert est.fits, est.why_not_fit


def test_symbolic_activation_formula_matches_numbers():
    import sympy

    from cost_models.memory import activation_expr
    from cost_models.workload import B, S, evaluate
    layer = block(0, hidden=H_, heads=A_, ffn_hidden=4 * H_, dropout=True, attention="unfused")
    for tp, sp, ck in ((8, True, "selective"), (4, False, "none"), (1, False, "full")):
        expr = activation_expr(layer, tp=tp, sequence_parallel=sp, checkpoint=ck)
        assert {B, S} >= expr.free_symbols
        assert evaluate(expr, B_, S_) == pytest.approx(activation_bytes(layer, B_, S_, tp=tp, sequence_parallel=sp,
                                                                        checkpoint=ck))
    # TP + SP + selective is exactly 34 s b h / t bytes
    assert sympy.simplify(activation_expr(layer, tp=8, sequence_parallel=True, checkpoint="selective")
                          - 34 * B * S * H_ / 8) == 0


def test_offload_is_bounded_by_host_memory():
    import json
    model = gpt("g", hidden=8192, heads=64, layers=16, seq_len=2048, vocab_size=51200)
    roomy = ClusterSpec.preset("dgx-a100")
    tight = ClusterSpec.from_dict({**roomy.to_dict(), "host_memory_gib": 64})
    layout = Layout(dp=8, micro_batch_size=1, zero=1, offload="optimizer", checkpoint="full")
    ok, bad = estimate(model, layout, roomy), estimate(model, layout, tight)
    assert ok.memory_breakdown[0]["optimizer"] == 0 and ok.memory_breakdown[0]["host"] > 0
    assert ok.fits and not bad.fits and "host memory" in bad.why_not_fit
    # offloading trades GPU memory for optimizer time
    on_gpu = estimate(model, Layout(**{**layout.to_dict(), "offload": "none"}), roomy)
    assert on_gpu.time_breakdown["optimizer_s"] < ok.time_breakdown["optimizer_s"]
    assert max(ok.peak_memory_bytes) < max(on_gpu.peak_memory_bytes)
    json.dumps(ok.to_dict())  # plain data, for the Plan
