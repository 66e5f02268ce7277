"""Float8 Linears: the plan's `LayerChoice.float8`, run by torchao.

`convert` swaps each named nn.Linear for torchao's Float8Linear (tensorwise dynamic
scaling, `convert_to_float8_training`, as torchtitan's float8 converter does) before
anything else is built: the module keeps its Parameters, so tensor parallelism
(DTensor weights: the tensorwise scale's amax is all-reduced over the tp group),
FSDP2, checkpointing, compiled blocks and pipeline stages compose with it as with a
Linear. FSDP2 all-gathers the weights in the training dtype (torchao's float8
all-gather is not lowered, and not priced). `check_runs` confirms, once the
parallelisms are applied, that every converted Linear still runs its own forward
(a piecewise tp split runs its GEMM itself: the planner does not offer float8 there).
"""
from __future__ import annotations

import torch.nn as nn

from autopar.errors import AutoparError, PlanMismatchError


def planned(plan) -> list[str]:
    """The nn.Linear module paths the plan runs in float8."""
    return [path for c in plan.layer_choices for path in (c.float8 or [])]


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
    convert_fn(model, config=config_cls(), module_filter_fn=lambda _module, fqn: fqn in wanted)
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
