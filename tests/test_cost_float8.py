"""Float8 Linears priced (cost_models/float8.py) and planned (`--compile --float8`).

What is checked: the float8 price of one Linear is its GEMMs at the device's float8
peak plus the casts' bytes (a large GEMM gains, a small one loses); the planner
turns float8 on per layer only where it is faster, names the Linears per layer in
the Plan and says why the others kept bf16; a device without float8 is refused
before any search; the plan's per-layer field is what is priced (clear it and the
estimate changes back).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from autopar.errors import AutoparError
from cost_models.analytic import llama
from cost_models.estimate import estimate
from cost_models.float8 import cast_times, converts, linear_times
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout
from cost_models.workload import OpSpec

ROOT = Path(__file__).resolve().parents[1]


def _linear(tokens: int, n: int, k: int) -> OpSpec:
    flops = 2 * tokens * n * k
    return OpSpec(name="w:mm", kind="gemm", fwd_flops=flops, bwd_flops=2 * flops, gemm=(tokens, n, k),
                  fwd_bytes=2 * (tokens * k + k * n + tokens * n), bwd_bytes=4 * (tokens * k + k * n + tokens * n),
                  linear=True, tp_sharded=True, tp_split="column")


def test_a_large_linear_gains_by_the_float8_rate_less_its_casts_and_a_small_one_loses():
    from cost_models.compute import op_times

    device = ClusterSpec.resolve("dgx-h100:1").device_profile
    kw = dict(work_divisor=1, byte_scale=1.0, gemm_split=1)
    big = _linear(8192, 4096, 4096)
    bf16 = sum(op_times(big, 1, None, device, dtype="bf16", **kw))
    f8 = sum(linear_times(big, 1, None, device, hp="bf16", **kw))
    casts = sum(cast_times(big, 1, None, device, hp="bf16", work_divisor=1, gemm_split=1))
    # bytes of the casts: forward 5 (M K + K N), backward 8 M N + 5 (M K + K N), at HBM speed
    hbm = device.memory_bandwidth * device.memory_efficiency
    assert casts == pytest.approx((5 * 2 * (8192 * 4096 + 4096 * 4096) + 8 * 8192 * 4096) / hbm)
    assert bf16 / 2 < f8 < bf16 and f8 == pytest.approx(sum(op_times(big, 1, None, device, dtype="fp8", **kw)) + casts)
    small = _linear(256, 256, 256)
    assert sum(linear_times(small, 1, None, device, hp="bf16", **kw)) > sum(op_times(small, 1, None, device,
                                                                                     dtype="bf16", **kw))
    # torch._scaled_mm wants multiples of 16 on each rank: 4096 / 8 is one, 24 / 2 is not
    assert converts(big, 1, None, 8) and not converts(_linear(64, 24, 64), 1, None, 2)
    assert not converts(dataclasses.replace(big, linear=False), 1, None, 1)  # a GEMM on a parameter, no nn.Linear
    pieces = dataclasses.replace(big, tp_pieces=3)  # a fused qkv cut into 3: split piecewise under tp
    assert not converts(pieces, 1, None, 2) and converts(pieces, 1, None, 1)


def test_float8_is_chosen_per_layer_where_faster_and_not_at_all_without_float8_tensor_cores():
    model = llama("llama3_8b", hidden=4096, heads=32, layers=4, seq_len=8192, vocab_size=128256, kv_heads=8,
                  ffn_hidden=14336)
    base = dict(tp=1, dp=8, micro_batch_size=1, num_micro_batches=2, zero=3, checkpoint="full")
    h100 = ClusterSpec.resolve("dgx-h100:1")
    bf16, f8 = estimate(model, Layout(**base), h100), estimate(model, Layout(**base, float8=True), h100)
    assert f8.layer_float8 == [False] + [True] * 5 and not any(bf16.layer_float8)  # the embedding has no Linear
    assert 1.1 < bf16.step_time_s / f8.step_time_s < 1.6  # torchtitan: 1.2-1.5x on Llama 3 8B, 8 H100
    assert f8.peak_memory_bytes == bf16.peak_memory_bytes  # torchao saves the high-precision tensors
    # explicit per-layer choices win over the automatic one: every layer off prices as bf16
    off = estimate(model, Layout(**base, float8=True, layer_float8=[False] * 6), h100)
    assert off.step_time_s == pytest.approx(bf16.step_time_s)
    # FSDP2 all-gathers the float8 weights in float8: a block's all-gather bytes about halve (its
    # norm weights stay bf16), and only where FSDP2 shards it (ZeRO 3 here, not DDP's ZeRO 0)
    from cost_models.layer import layer_cost

    def gathered(float8, **change):
        layout = Layout(**{**base, "zero": 3, **change})
        cost = layer_cost(model.layers[1], model, layout, h100, float8=float8)
        return sum(b for kind, b, _ in cost.dp_collectives if kind == "all_gather")
    block = model.layers[1]
    assert gathered(True) == pytest.approx(gathered(False) * (block.params + 8192) / (2 * block.params), rel=1e-6)
    assert gathered(True, zero=0) == gathered(False, zero=0) == 0
    # over tp the lowering all-gathers bf16 (float8 all-gathers trained wrong there), and so it is priced
    assert gathered(True, tp=2, dp=4) == pytest.approx(gathered(False, tp=2, dp=4))
    a100 = ClusterSpec.resolve("dgx-a100:1")
    without = estimate(model, Layout(**base), a100).step_time_s
    assert estimate(model, Layout(**base, float8=True), a100).step_time_s == without


def _tiny_llama():
    sys.path.insert(0, str(ROOT / "examples"))
    import llama as examples_llama
    return examples_llama.llama_tiny()


def test_the_planner_names_the_float8_linears_prices_the_field_and_says_why_others_kept_bf16():
    from autopar.engine import COMPILED_FLOAT8
    from autopar.plan import Plan
    from autopar.solve import layout_of, plan

    net, inputs = _tiny_llama()
    kw = dict(example_inputs=inputs, global_batch_size=8, constraints=dict(tp=1, pp=1, zero=3, micro_batch=1))
    tiny = plan(net, "dgx-h100:1", engine=COMPILED_FLOAT8, **kw)
    # 32-wide Linears: the casts cost more than the float8 GEMMs save, so none runs float8, and the plan says why
    assert not any(c.float8 for c in tiny.layer_choices)
    kept = tiny.assumptions["float8"]["kept_bf16"]
    assert set(kept) == {c.name for c in tiny.layer_choices if c.kind in ("transformer_block", "head")}
    assert all("slower in float8" in why for why in kept.values())

    big = llama("llama3_8b", hidden=4096, heads=32, layers=4, seq_len=8192, vocab_size=128256, kv_heads=8,
                ffn_hidden=14336)
    p = plan(big, "dgx-h100:1", engine=COMPILED_FLOAT8, global_batch_size=16,
             constraints=dict(tp=1, pp=1, zero=3, micro_batch=1))
    assert [len(c.float8) for c in p.layer_choices] == [0] + [7] * 4 + [1]
    assert p.assumptions["float8"]["linears"] == 29 and "kept_bf16" not in p.assumptions["float8"]
    again = Plan.from_json(p.to_json())
    assert estimate(big, layout_of(again), ClusterSpec.resolve("dgx-h100:1")).step_time_s == pytest.approx(
        p.predicted.step_time_s)
    for c in again.layer_choices:  # the field is priced: without it the same plan is slower
        c.float8 = []
    slower = estimate(big, layout_of(again), ClusterSpec.resolve("dgx-h100:1")).step_time_s
    assert slower > 1.1 * p.predicted.step_time_s

    with pytest.raises(AutoparError, match="a100-80g has no float8 tensor cores"):
        plan(big, "dgx-a100:1", engine=COMPILED_FLOAT8, global_batch_size=16)


def test_float8_needs_compiled_blocks():
    from autopar.engine import COMPILED_FLOAT8, engine_from_options

    assert engine_from_options(None, compiled_blocks=True, float8=True) == COMPILED_FLOAT8
    with pytest.raises(AutoparError, match="--float8 needs --compile"):
        engine_from_options(None, float8=True)
