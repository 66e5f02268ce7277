"""Plan.grad_reduce_dtype lowered (autopar/lower/compression.py) on 2 gloo ranks:

(a) what runs is what the plan says: FSDP2's reduce dtype is bf16 exactly when the plan
    says bf16 ('as held' otherwise) and the gradients the optimizer reads stay fp32;
    under replicate, DDP's bf16_compress_hook is registered exactly then, and where this
    torch's DDP refuses the hook (CPU builds) preflight refuses the plan with the reason.
(b) accuracy: a small decoder (examples/gpt.py gpt_tiny) trains 50 AdamW steps (lr 3e-3)
    under FSDP2 ZeRO 3 with and without bf16 reduction from the same seed and batches.

The bound, and why it is fair. bf16 keeps 8 significant bits: one rounding moves a value
by at most U = 2^-8 of itself. FSDP2 rounds each gradient twice (each rank's into the bf16
buffer, then the reduced sum), so every step's gradient is off by at most 2U per element,
and AdamW's update m / sqrt(v) by about as much. To first order a step's loss decrease is
the gradient times the update, so the loss lost or gained to the rounding over steps
0..t-1 is at most 2U of the decrease they made: |L_bf16(t) - L_fp32(t)| <= 2U x (L(0) -
L(t)). The test allows twice that (second-order terms; AdamW's v moves too), plus the fp32
floor (the uncompressed 2-rank run against one process: 6e-7 relative here). It also
requires the two runs to differ by more than that floor, or the field was ignored. A
coarser format (fp8: 2^-4) or a wrong scale (a sum not divided by the group size) breaks
it. Measured: worst 5.1e-4 relative over 50 steps (loss 4.88 -> 3.55); one rounding of
the gradient per step in one process gives 5.4e-5.
"""
import pytest

from compression_worlds import replicate_world, train_world
from dist_utils import run_world

U = 2.0 ** -8  # bf16's unit roundoff
FP32_FLOOR = 1e-5  # relative: what reduction order alone moves an fp32 loss (6e-7 measured)
STEPS = 50
LAYOUTS = [
    ("fsdp_fp32", dict(dp=2, zero=3)),
    ("fsdp_bf16", dict(dp=2, zero=3, grad_reduce_dtype="bf16")),
]


# DDP (replicate) with its bf16_compress_hook: only where DDP takes the hook (a CUDA / NCCL
# torch, gloo ranks on CPU tensors included); a CPU-only torch refuses it (tested below)
DDP_LAYOUTS = [("ddp_fp32", dict(dp=2, zero=0)), ("ddp_bf16", dict(dp=2, zero=0, grad_reduce_dtype="bf16"))]


def _ddp_runs() -> bool:
    from autopar.lower.compression import ddp_hook_refusal
    return ddp_hook_refusal() is None


@pytest.fixture(scope="module")
def trained():
    return run_world(train_world, 2, LAYOUTS + (DDP_LAYOUTS if _ddp_runs() else []), STEPS, timeout=280)


@pytest.mark.timeout(300)
def test_what_runs_under_fsdp2_is_what_the_plan_says(trained):
    r = trained[0]
    assert r["fsdp_bf16"]["runs"]["fsdp_reduce_dtypes"] == ["bfloat16"]
    assert r["fsdp_fp32"]["runs"]["fsdp_reduce_dtypes"] == ["as held"]
    assert r["fsdp_bf16"]["grad_dtypes"] == ["torch.float32"]  # cast back: the optimizer reads fp32


@pytest.mark.timeout(300)
def test_bf16_reduction_trains_within_the_rounding_bound(trained):
    for rank in trained[1:]:  # every rank steps the same model
        assert all(rank[n]["losses"] == trained[0][n]["losses"] for n in rank)
    _within_the_bound(trained[0]["fsdp_fp32"]["losses"], trained[0]["fsdp_bf16"]["losses"])


@pytest.mark.timeout(300)
def test_ddp_bf16_hook_trains_within_the_rounding_bound(trained):
    if not _ddp_runs():
        pytest.skip("this torch's DDP refuses bf16_compress_hook (CPU-only build); preflight refuses it, tested below")
    r = trained[0]
    assert r["ddp_bf16"]["runs"]["ddp_hooks"] == ["bf16_compress_hook"] and r["ddp_fp32"]["runs"]["ddp_hooks"] == []
    _within_the_bound(r["ddp_fp32"]["losses"], r["ddp_bf16"]["losses"])


def _within_the_bound(a, b):
    assert a[-1] < 0.8 * a[0]  # it learns: the bound is tested on a moving trajectory
    assert max(abs(x - y) / x for x, y in zip(a, b)) > FP32_FLOOR, "bf16 reduction changed nothing: field ignored"
    used = [abs(x - y) / (2 * 2 * U * (a[0] - x) + FP32_FLOOR * x) for x, y in zip(a, b)]
    print(f"worst relative loss difference {max(abs(x - y) / x for x, y in zip(a, b)):.2e}; "
          f"worst share of the bound {max(used):.2f}; losses {a[0]:.3f} -> {a[-1]:.3f}")
    assert max(used) <= 1, [(t, x, y) for t, (x, y, u) in enumerate(zip(a, b, used)) if u > 1]


@pytest.mark.timeout(120)
def test_replicate_registers_ddp_bf16_hook_only_when_asked():
    r = run_world(replicate_world, 2, timeout=100)[0]
    assert r["bf16"]["ddp_hooks"] == ["bf16_compress_hook"] and r["as_held"]["ddp_hooks"] == []


def test_preflight_refuses_ddp_compression_where_ddp_refuses_the_hook(monkeypatch):
    from autopar.errors import PlanMismatchError
    from autopar.lower import compression, preflight
    from autopar.lower.manual_plan import plan_for_model
    from autopar.lower.model_layers import resolve
    from gpt import gpt_tiny
    model, example = gpt_tiny()
    plan = plan_for_model(model, example_inputs=example, dp=2, zero=0, grad_reduce_dtype="bf16")
    monkeypatch.setattr(compression, "ddp_hook_refusal", lambda: "DDP says no")
    with pytest.raises(PlanMismatchError, match="grad_reduce_dtype 'bf16' cannot run: DDP says no"):
        preflight.check_plan(model, plan, resolve(model, plan))
    fsdp = plan_for_model(model, example_inputs=example, dp=2, zero=3, grad_reduce_dtype="bf16")
    preflight.check_plan(model, fsdp, resolve(model, fsdp))  # FSDP2 takes bf16 whatever DDP says
