"""Float8 Linears: the plan's `LayerChoice.float8`, run by torchao.

`convert` swaps each named nn.Linear for torchao's Float8Linear (tensorwise dynamic
scaling, `convert_to_float8_training`, as torchtitan's float8 converter does) before
anything else is built: the module keeps its Parameters, so tensor parallelism
(DTensor weights: the tensorwise scale's amax is all-reduced over the tp group),
FSDP2, checkpointing, compiled blocks and pipeline stages compose with it as with a
Linear. Where FSDP2 shards them (dp > 1 without DDP, no tp), it all-gathers their weights in
float8 (torchao's `enable_fsdp_float8_all_gather`: each shard cast before the
all-gather, one byte per element on the wire), with the scales of all of them
computed in one all-reduce after each optimizer step
(`precompute_float8_dynamic_scale_for_fsdp`, `precompute_scales`). `check_runs` confirms, once the
parallelisms are applied, that every converted Linear still runs its own forward
(a piecewise tp split runs its GEMM itself: the planner does not offer float8 there).
"""
from __future__ import annotations

import torch.nn as nn

from autopar.errors import AutoparError, PlanMismatchError
from autopar.lower.data_parallel import uses_replicate


def planned(plan) -> list[str]:
    """The nn.Linear module paths the plan runs in float8."""
    return [path for c in plan.layer_choices for path in (c.float8 or [])]


def gathers_in_float8(plan) -> bool:
    """FSDP2 all-gathers the float8 Linears' weights in float8: every layer is FSDP2's
    (dp > 1, not DDP's replicate), no tp, and some Linear runs float8. The cost model's
    rule too: ZeRO >= 2 over dp > 1, tp 1 (cost_models/float8.py, layer_comm.py).
    Not over tp: FSDP2's float8 all-gather of weights tp splits as well trained 12% away
    from one process (torch 2.13, torchao 0.18, llama tiny tp 2 x dp 2, 3 steps; bf16
    all-gathers there match to 2e-7), so those run their all-gathers in bf16."""
    return bool(planned(plan)) and plan.mesh.dp > 1 and plan.mesh.tp == 1 and not uses_replicate(plan)


def precompute_scales(pm) -> None:
    """After the optimizer's step: the next all-gathers' float8 scales, one all-reduce."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for stage in pm.stages:
        precompute_float8_dynamic_scale_for_fsdp(stage)


def _torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as exc:
        raise AutoparError(f"this plan runs float8 Linears, which needs torchao ({exc})",
                           hint="pip install torchao, or re-plan without --float8") from exc
    return Float8LinearConfig, convert_to_float8_training, Float8Linear


def convert(model: nn.Module, plan) -> int:
    """Swap the plan's float8 Linears in `model` for Float8Linear; -> how many."""
    paths = planned(plan)
    if not paths:
        return 0
    modules = dict(model.named_modules())
    for path in paths:
        module = modules.get(path)
        if module is None or not isinstance(module, nn.Linear):
            what = "has no module" if module is None else f"holds a {type(module).__name__}, not an nn.Linear"
            raise PlanMismatchError(f"the plan runs '{path}' in float8, but the model {what} there",
                                    hint="was the plan made for another model? re-plan with --float8")
    config_cls, convert_fn, _ = _torchao()
    wanted = set(paths)
    config = config_cls(enable_fsdp_float8_all_gather=gathers_in_float8(plan))
    convert_fn(model, config=config, module_filter_fn=lambda _module, fqn: fqn in wanted)
    return len(wanted)


def check_runs(model: nn.Module, plan) -> None:
    """Every planned float8 Linear is a Float8Linear that runs its own forward."""
    paths = planned(plan)
    if not paths:
        return
    _, _, float8_linear = _torchao()
    modules = dict(model.named_modules())
    for path in paths:
        module = modules.get(path)
        if module is None:
            continue  # on another pipeline rank
        if not isinstance(module, float8_linear) or "forward" in vars(module):
            raise PlanMismatchError(
                f"the plan runs '{path}' in float8, but the lowering runs its GEMM otherwise (a piecewise "
                f"tensor-parallel split computes it itself)", hint="re-plan: the planner keeps such Linears in bf16")
