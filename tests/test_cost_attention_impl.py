"""Attention priced by which kernel ran it (docs/cost_model.md section 2).

- a tiled causal kernel computes the tiles on the diagonal whole: it executes
  (n + 1) / 2n of the unmasked FLOPs for n = s / 128 query tiles, not one half;
- older fused kernels run at the fraction of FlashAttention-2's speed the
  FlashAttention-2 paper measured (section 4.1): the 2022 Triton kernel 1/1.4
  forward and 1/2 backward, FlashAttention v1 1/2;
- an unknown kernel name is refused, not priced as the default."""
import pytest

from cost_models.analytic import block, gpt
from cost_models.compute import ATTENTION_IMPL_SPEED, causal_fraction, executed_flops, op_times
from cost_models.errors import CostModelError
from cost_models.estimate import layer_fingerprint
from cost_models.hardware import get_device
from cost_models.workload import OpSpec


def test_causal_fraction_counts_the_diagonal_tiles():
    assert causal_fraction(128) == pytest.approx(1.0)  # one tile: computed whole
    assert causal_fraction(512) == pytest.approx(0.625)  # 4 tiles: 10 of 16
    assert causal_fraction(2048) == pytest.approx(17 / 32)
    assert causal_fraction(1 << 20) == pytest.approx(0.5, abs=1e-3)
    # monotone: longer sequences waste less on the diagonal
    fractions = [causal_fraction(s) for s in (256, 512, 1024, 4096, 65536)]
    assert fractions == sorted(fractions, reverse=True)


def _attention(impl=None, causal=True):
    b, s, h = 4, 4096, 2048
    flops = 4 * b * s * s * h
    return OpSpec(name="attention", kind="attention", fwd_flops=flops, bwd_flops=2.5 * flops,
                  fwd_bytes=0, bwd_bytes=0, causal=causal, impl=impl)


def test_causal_time_follows_the_executed_tiles():
    dev = get_device("a100-80g")
    causal_f, _ = op_times(_attention(), 4, 4096, dev)
    full_f, _ = op_times(_attention(causal=False), 4, 4096, dev)
    assert causal_f / full_f == pytest.approx(causal_fraction(4096))
    fwd, _ = executed_flops(_attention(), 4, 4096)
    assert fwd == pytest.approx(_attention().fwd_flops * causal_fraction(4096))


@pytest.mark.parametrize("impl", ["flash-triton", "flash1"])
def test_older_kernels_run_at_their_published_fraction(impl):
    dev = get_device("h100-sxm")
    f2, b2 = op_times(_attention(), 4, 4096, dev)
    f, b = op_times(_attention(impl), 4, 4096, dev)
    speed_f, speed_b = ATTENTION_IMPL_SPEED[impl]
    assert f == pytest.approx(f2 / speed_f) and b == pytest.approx(b2 / speed_b)
    assert f > f2 and b > b2


def test_block_carries_the_kernel_and_only_attention_changes():
    kw = dict(hidden=1024, heads=8, ffn_hidden=4096)
    fa2, triton = block(0, **kw), block(0, attention="flash-triton", **kw)
    dev = get_device("a100-80g")
    for a, b in zip(fa2.ops, triton.ops):
        ta, tb = op_times(a, 2, 2048, dev), op_times(b, 2, 2048, dev)
        if a.kind == "attention":
            assert b.impl == "flash-triton" and tb[0] > ta[0] and tb[1] > ta[1]
        else:
            assert ta == tb
    assert fa2.activation_bytes == triton.activation_bytes  # same tensors saved
    # the cost cache keys on the op fields: the two kernels never share a cached price
    assert layer_fingerprint(fa2) != layer_fingerprint(triton)


def test_unknown_kernel_is_refused():
    with pytest.raises(CostModelError, match="unknown kernel implementation 'flash9'"):
        op_times(_attention("flash9"), 4, 4096, get_device("a100-80g"))
    with pytest.raises(CostModelError, match="attention='sdpa-magic'"):
        gpt("x", hidden=256, heads=4, layers=2, seq_len=128, vocab_size=512, attention="sdpa-magic")
