"""Every fused kernel against its torch reference, through the Triton path.

conftest.py sets TRITON_INTERPRET=1, so on this GPU-less machine the Triton
kernels themselves run (in the interpreter), not the torch fallback; the
first test checks that, so the rest cannot silently compare the reference
with itself.
"""
import math
import os
import zlib

import pytest
import torch

from autopar.errors import AutoparError
from autopar.kernels import REGISTRY, dropout_add, dropout_mask, poison_outputs, use_triton
from autopar.kernels import _runtime
from autopar.kernels.dropout_add import philox_uniform

pytestmark = pytest.mark.triton  # these run the Triton kernels (interpreter on CPU)

NAMES = sorted(REGISTRY)
# Shapes with three leading dims and a non-power-of-two width (the kernels'
# masks must cover the tail), one per kernel family's argument convention.
ODD_SHAPE = {"scaled_masked_softmax": (2, 3, 7, 1000), "linear_cross_entropy": (2, 3, 5, 48, 1000)}
DEFAULT_ODD = (2, 3, 5, 1000)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _leaf(a, dtype=None):
    if not torch.is_tensor(a):
        return a
    a = a.detach().clone()
    if dtype is not None and a.is_floating_point():
        a = a.to(dtype)
    return a.requires_grad_(a.is_floating_point())


def _tuple(o):
    return o if isinstance(o, tuple) else (o,)


def _run(fn, args, grads_seed=0, grad_dtype=None):
    """Forward, then backward with fixed random output gradients (rounded to
    `grad_dtype` first, so a low-precision run and its fp32 truth see the
    same gradient values)."""
    outs = _tuple(fn(*args))
    g = torch.Generator().manual_seed(1000 + grads_seed)
    grads = [torch.randn(o.shape, generator=g).to(grad_dtype or o.dtype).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs], [a.grad for a in args if torch.is_tensor(a) and a.requires_grad]


def _assert_close(got, want, tol, what):
    got, want = got.float(), want.float()
    assert got.shape == want.shape, what
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    # relative to the tensor's scale: elementwise-relative error is meaningless
    # where the true value crosses zero.
    scale = want.abs().max().clamp_min(1e-30)
    err = ((got - want).abs() / (want.abs() + scale * tol)).max()
    worst = float((got - want).abs().max() / scale)
    assert worst <= tol, f"{what}: max error {worst:.2e} of the tensor's scale > {tol:.0e}"
    assert float(err) <= 2.0, f"{what}: elementwise error {float(err):.2f} x tolerance"


def test_triton_path_is_what_runs_here():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert use_triton(torch.ones(2))
    # The Triton path leaves a trace the reference cannot: the autograd node of
    # autopar's torch.library op appears in the graph.
    g, u = REGISTRY["swiglu"][2](0, (4, 10))
    y = REGISTRY["swiglu"][0](g.requires_grad_(), u)
    assert "autopar_swiglu" in type(y.grad_fn).__name__


def test_fallback_when_triton_is_off(monkeypatch):
    monkeypatch.setenv("AUTOPAR_KERNELS", "torch")
    assert not use_triton(torch.ones(2))
    g, u = REGISTRY["swiglu"][2](0, (4, 10))
    y = REGISTRY["swiglu"][0](g.requires_grad_(), u)
    assert "autopar" not in type(y.grad_fn).__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", NAMES)
def test_kernel_matches_reference(name, dtype):
    triton_fn, reference_fn, make_inputs = REGISTRY[name]
    shape = ODD_SHAPE.get(name, DEFAULT_ODD)
    inputs = make_inputs(seed=zlib.crc32(name.encode()) % 1000, shape=shape, dtype=dtype)  # stable across runs
    floats = [a for a in inputs if torch.is_tensor(a) and a.is_floating_point()]
    assert all(a.abs().sum() > 0 for a in floats), "inputs must be random, never zeros"
    assert all(a.dtype == dtype for a in floats)
    got_out, got_grad = _run(triton_fn, [_leaf(a) for a in inputs])
    # The truth is the reference in fp32 on the same (rounded) inputs: a
    # low-precision reference would add its own rounding to the comparison.
    want_out, want_grad = _run(reference_fn, [_leaf(a, torch.float32) for a in inputs], grad_dtype=dtype)
    assert len(got_grad) == len(want_grad) > 0
    for i, (g, w) in enumerate(zip(got_out, want_out)):
        assert g.dtype == dtype, f"output {i} dtype {g.dtype}"
        _assert_close(g, w, TOL[dtype], f"{name} output {i}")
    for i, (g, w) in enumerate(zip(got_grad, want_grad)):
        assert g.dtype == dtype, f"grad {i} dtype {g.dtype}"
        _assert_close(g, w, TOL[dtype], f"{name} grad {i}")


COMPILE_SHAPE = {"scaled_masked_softmax": (2, 2, 8, 8), "linear_cross_entropy": (6, 16, 50),
                 "cross_entropy": (6, 50)}


@pytest.mark.parametrize("name", NAMES)
def test_kernel_is_one_opaque_op_under_torch_compile(name):
    """Issue 31: compiled code calls each kernel as its torch.library op (fullgraph: no
    graph break, which would send a compiled block back to eager), forward and backward
    matching the reference."""
    import torch._dynamo

    triton_fn, reference_fn, make_inputs = REGISTRY[name]
    inputs = make_inputs(seed=1, shape=COMPILE_SHAPE.get(name, (4, 64)))
    from torch._inductor.compile_fx import compile_fx

    seen = []

    def inductor_seeing(gm, example_inputs):  # what dynamo hands inductor, then inductor itself
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: triton_fn(*a), fullgraph=True, backend=inductor_seeing)
    got_out, got_grad = _run(compiled, [_leaf(a) for a in inputs])
    want_out, want_grad = _run(reference_fn, [_leaf(a) for a in inputs])
    assert len(got_grad) == len(want_grad) > 0
    for i, (g, w) in enumerate(zip(got_out + got_grad, want_out + want_grad)):
        _assert_close(g, w, 1e-5, f"{name} compiled, tensor {i}")
    # the kernel is in the compiled graph as autopar's op (neither traced into nor the reference)
    assert any(t.startswith("autopar.") for t in seen), seen


@pytest.mark.parametrize("name", NAMES)
def test_every_output_element_is_written(name):
    triton_fn, _, make_inputs = REGISTRY[name]
    inputs = make_inputs(seed=7, shape=ODD_SHAPE.get(name, DEFAULT_ODD))
    with poison_outputs():
        outs, grads = _run(triton_fn, [_leaf(a) for a in inputs])
    for t in outs + grads:
        assert torch.isfinite(t.float()).all(), f"{name}: an output element was never written"


def test_poisoning_is_real():
    # Proves the test above can fail: buffers really start as NaN.
    with poison_outputs():
        assert torch.isnan(_runtime.new_empty((3, 5), torch.float32, "cpu")).all()
    assert not _runtime._POISON[0]


@pytest.mark.parametrize("name", ["add_layernorm", "add_rmsnorm", "swiglu"])
def test_other_leading_shapes(name):
    triton_fn, reference_fn, make_inputs = REGISTRY[name]
    for shape in [(1000,), (1, 3), (33, 127)]:
        inputs = make_inputs(seed=3, shape=shape)
        got, got_g = _run(triton_fn, [_leaf(a) for a in inputs])
        want, want_g = _run(reference_fn, [_leaf(a) for a in inputs])
        for g, w in zip(got + got_g, want + want_g):
            _assert_close(g, w, 1e-5, f"{name} {shape}")


def test_norm_weight_grad_reduced_across_many_row_programs():
    # 4200 rows: more rows than partial-sum programs, so each program sums many rows.
    triton_fn, reference_fn, make_inputs = REGISTRY["add_layernorm"]
    inputs = make_inputs(seed=9, shape=(4200, 300))
    got, got_g = _run(triton_fn, [_leaf(a) for a in inputs])
    want, want_g = _run(reference_fn, [_leaf(a) for a in inputs])
    for g, w in zip(got + got_g, want + want_g):
        _assert_close(g, w, 1e-5, "add_layernorm 4200x300")


def test_cross_entropy_vocab_wider_than_one_block():
    # 5000 > the 4096-wide block: exercises the online log-sum-exp across blocks.
    triton_fn, reference_fn, make_inputs = REGISTRY["cross_entropy"]
    inputs = make_inputs(seed=5, shape=(3, 5000))
    got, got_g = _run(triton_fn, [_leaf(a) for a in inputs])
    want, want_g = _run(reference_fn, [_leaf(a) for a in inputs])
    for g, w in zip(got + got_g, want + want_g):
        _assert_close(g, w, 1e-5, "cross_entropy V=5000")


@pytest.mark.parametrize("reduction", ["sum", "none"])
def test_cross_entropy_reductions(reduction):
    triton_fn, reference_fn, make_inputs = REGISTRY["cross_entropy"]
    logits, targets = make_inputs(seed=6, shape=(4, 3, 333))
    got, got_g = _run(lambda x: triton_fn(x, targets, reduction=reduction), [_leaf(logits)])
    want, want_g = _run(lambda x: reference_fn(x, targets, reduction=reduction), [_leaf(logits)])
    for g, w in zip(got + got_g, want + want_g):
        _assert_close(g, w, 1e-5, f"cross_entropy {reduction}")


def test_linear_cross_entropy_chunks_agree():
    triton_fn, reference_fn, make_inputs = REGISTRY["linear_cross_entropy"]
    h, w, t = make_inputs(seed=8, shape=(13, 40, 700))
    want, want_g = _run(lambda a, b: reference_fn(a, b, t), [_leaf(h), _leaf(w)])
    for chunk in (1, 5, 13, 4096):  # uneven last chunk included
        got, got_g = _run(lambda a, b: triton_fn(a, b, t, chunk_rows=chunk), [_leaf(h), _leaf(w)])
        for g, r in zip(got + got_g, want + want_g):
            _assert_close(g, r, 1e-5, f"linear_cross_entropy chunk={chunk}")


def test_cross_entropy_all_ignored_is_nan_like_torch():
    logits = torch.randn(4, 50)
    targets = torch.full((4,), -100)
    ref = torch.nn.functional.cross_entropy(logits, targets)
    assert math.isnan(float(ref))
    assert math.isnan(float(REGISTRY["cross_entropy"][0](logits, targets)))
    assert math.isnan(float(REGISTRY["linear_cross_entropy"][0](torch.randn(4, 8), torch.randn(50, 8), targets)))


# -- dropout ------------------------------------------------------------------

def test_dropout_mask_matches_philox_reference_exactly():
    # The torch Philox replica reproduces tl.rand bit for bit, so the fallback
    # and the kernel drop the same elements.
    x, r = torch.randn(7, 999), torch.randn(7, 999)
    y = dropout_add(x, r, p=0.3, seed=42)
    kept = y != r
    assert torch.equal(kept, dropout_mask(42, x.shape, 0.3) & (x != 0))
    torch.testing.assert_close(y, REGISTRY["dropout_add"][1](x, r, 0.3, 42), rtol=0, atol=0)


def test_philox_uniforms_are_uniform():
    u = philox_uniform(123, torch.arange(200_000))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float(u.var()) - 1 / 12) < 0.002


def test_dropout_statistics_and_backward_uses_the_same_mask():
    p, n = 0.25, (6, 2500)
    x = (torch.randn(n) + 3.0).requires_grad_()  # nonzero, so dropped == (y == r)
    r = torch.randn(n).requires_grad_()
    y = dropout_add(x, r, p=p, seed=99)
    dropped = (y == r)
    frac = float(dropped.float().mean())
    sigma = math.sqrt(p * (1 - p) / dropped.numel())
    assert abs(frac - p) < 5 * sigma, f"dropped fraction {frac} vs p={p}"
    torch.testing.assert_close(y[~dropped], (r + x / (1 - p))[~dropped])
    dy = torch.randn(n)
    y.backward(dy)
    assert torch.equal(x.grad == 0, dropped)  # same elements as the forward dropped
    torch.testing.assert_close(x.grad[~dropped], dy[~dropped] / (1 - p))
    torch.testing.assert_close(r.grad, dy)


def test_dropout_seed_determinism():
    x, r = torch.randn(3, 333), torch.randn(3, 333)
    a = dropout_add(x, r, p=0.5, seed=1)
    assert torch.equal(a, dropout_add(x, r, p=0.5, seed=1))
    assert not torch.equal(a, dropout_add(x, r, p=0.5, seed=2))


def test_dropout_p0_and_eval_are_exact_add():
    x, r = torch.randn(3, 5, 1000), torch.randn(3, 5, 1000)
    assert torch.equal(dropout_add(x, r, p=0.0, seed=3), x + r)
    assert torch.equal(dropout_add(x, r, p=0.7, seed=3, training=False), x + r)


# -- bad input ------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda: REGISTRY["add_layernorm"][0](torch.randn(3, 8), torch.randn(3, 9), None, None),
    lambda: dropout_add(torch.randn(3), torch.randn(3), p=1.0),
    lambda: REGISTRY["cross_entropy"][0](torch.randn(3, 8), torch.zeros(4, dtype=torch.long)),
    lambda: REGISTRY["linear_cross_entropy"][0](torch.randn(3, 8), torch.randn(10, 7), torch.zeros(3, dtype=torch.long)),
    lambda: REGISTRY["scaled_masked_softmax"][0](torch.randn(8)),
    lambda: REGISTRY["cross_entropy"][0](torch.randn(3, 8), torch.tensor([0, 8, 1])),
    lambda: REGISTRY["linear_cross_entropy"][0](torch.randn(3, 4), torch.randn(8, 4), torch.tensor([0, -5, 1])),
])
def test_bad_input_raises_actionable_error(call):
    with pytest.raises(AutoparError):
        call()


def test_benchmark_script_runs_end_to_end(tmp_path):
    # The GPU benchmark cannot run here; its smoke mode (interpreter, tiny
    # size) keeps the script itself from rotting.
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("bench_kernels", _runtime.__file__.rsplit("autopar", 1)[0] + "benchmarks/kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--no-compile", "--kernels", "swiglu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernels_cpu_interpreter.json").read_text())
    assert result["smoke"] is True and result["device"] == "cpu-interpreter"
    (row,) = result["rows"]
    assert row["kernel"] == "swiglu" and row["triton_fwd_bwd_s"] > 0 and row["eager_fwd_bwd_s"] > 0
    assert row["max_rel_err"] < 1e-2
    assert "Smoke run" in (tmp_path / "kernels_cpu_interpreter.md").read_text()
