"""Communication compression in the planner (solve/compression.py): priced and said by
default, kept under --grad-reduce-dtype auto when faster or bf16 (a pin), never where
nothing is compressed (bf16 gradients; no pricing then), and the pin's spelling checked."""
import pytest

import autopar
from autopar.solve.constraints import ConstraintError, parse_constraints
from cost_models.analytic import gpt


@pytest.fixture(scope="module")
def model():
    return gpt("g", hidden=2048, heads=16, layers=4, seq_len=1024, vocab_size=32000)


def _plan(model, precision="fp32", pin=None):
    return autopar.plan(model, "dgx-h100:2", global_batch_size=64, precision=precision, top_k=1,
                        constraints={"grad_reduce_dtype": pin} if pin else None)


def test_default_prices_it_and_says_why_it_is_not_chosen(model):
    plan = _plan(model)
    assert plan.grad_reduce_dtype is None
    assert "bf16 reduction would take" in plan.solver["compression"] and "not chosen" in plan.solver["compression"]


def test_auto_keeps_bf16_reduction_where_it_is_faster_and_the_plan_prices_it(model):
    plain, squeezed = _plan(model), _plan(model, pin="auto")
    assert squeezed.grad_reduce_dtype == "bf16" and "faster" in squeezed.solver["compression"]
    assert squeezed.predicted.step_time_s < plain.predicted.step_time_s
    from autopar.solve.layout import layout_of
    assert layout_of(squeezed).grad_reduce_dtype == "bf16"  # what the plan says is what is priced
    assert squeezed.solver["status"] == "feasible"  # the solver's optimum was over uncompressed prices


def test_pins(model):
    assert _plan(model, pin="fp32").grad_reduce_dtype is None
    assert _plan(model, pin="bf16").grad_reduce_dtype == "bf16"
    bf16 = _plan(model, precision="bf16", pin="bf16")  # main_grads same: nothing to compress
    assert bf16.grad_reduce_dtype is None and "reduced in bf16 already" in bf16.solver["compression"]


def test_nothing_to_compress_adds_nothing_to_the_plan(model):
    assert "compression" not in _plan(model, precision="bf16").solver


def test_the_pin_is_spelled_as_the_cli_says():
    assert parse_constraints({"grad_reduce_dtype": "BF16"}).grad_reduce_dtype == "bf16"
    with pytest.raises(ConstraintError, match="--grad-reduce-dtype must be one of fp32, bf16, auto"):
        parse_constraints({"grad_reduce_dtype": "int8"})


def test_cpu_ranks_compress_under_fsdp2_only(model):
    """DDP refuses its bf16 hook without CUDA / NCCL: a replicate layout on CPU ranks is not
    compressed (and says why); a ZeRO 3 one is (FSDP2's reduce_dtype runs on gloo)."""
    from autopar.solve.planner import scaled_cluster
    from cost_models.hardware import ClusterSpec
    cpu = scaled_cluster(ClusterSpec.resolve("cpu"), 1, 2)
    small = gpt("s", hidden=64, heads=4, layers=2, seq_len=16, vocab_size=128)
    plan = lambda zero: autopar.plan(small, cpu, global_batch_size=4, precision="fp32", top_k=1,  # noqa: E731
                                     constraints={"grad_reduce_dtype": "bf16", "dp": 2, "zero": zero})
    ddp, fsdp = plan(0), plan(3)
    assert ddp.grad_reduce_dtype is None and "DDP's bf16_compress_hook needs" in ddp.solver["compression"]
    assert fsdp.grad_reduce_dtype == "bf16"
