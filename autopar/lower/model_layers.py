"""Map a Plan's layers onto the user's module tree, and check that they match.

A plan names layers; each `LayerChoice.module_paths` lists the modules of the
user's model it covers (`blocks.3`, or `wte` + `wpe` for an embedding
layer). Lowering never guesses a layer from names: it resolves these paths,
and refuses a model that differs from the planned one (a missing module, a
parameter count that is not the planned one) before any collective runs,
because a mismatch found later shows up as a hang or a silent wrong answer.

Vocabulary used by the other lowering files:
  - block: a layer whose single module sits in the model's repeated
    `nn.ModuleList` (the transformer blocks); pipeline stages cut between
    blocks.
  - pre layers (embeddings) run before the first block, post layers (final
    norm, head) after the last one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from autopar.errors import PlanMismatchError
from autopar.plan import LayerChoice, Plan


@dataclass
class ResolvedLayer:
    choice: LayerChoice
    stage: int  # stage index in execution order
    paths: list[str]  # module paths
    block_index: int | None = None  # position in the block ModuleList, None for pre/post layers
    position: str = "block"  # "pre" | "block" | "post"
    # Parameters the layer owns that no module of it holds (a root-level
    # `pos_embedding` or `class_token`): capture lists them by parameter path.
    # They stay in the stage's root FSDP unit and are never tensor-parallel.
    param_paths: list[str] = field(default_factory=list)
    stack: str | None = None  # the ModuleList a block sits in


@dataclass
class ModelLayout:
    """The plan's layers resolved against one model."""

    layers: list[ResolvedLayer]
    blocks_path: str | None  # the nn.ModuleList holding the blocks, when there is one stack
    num_blocks: int  # over all stacks
    tied: list[list[str]] = field(default_factory=list)  # parameter names sharing one tensor
    stacks: list[str] = field(default_factory=list)  # block ModuleLists in execution order (2: encoder-decoder)
    stack_ends: dict = field(default_factory=dict)  # stack -> (first, last) block_index

    def first_last(self, layer: ResolvedLayer) -> tuple[bool, bool]:
        """Whether a block starts / ends its stack (sequence parallelism
        scatters into and gathers out of each stack)."""
        first, last = self.stack_ends[layer.stack]
        return layer.block_index == first, layer.block_index == last

    def layers_of_stage(self, stage: int) -> list[ResolvedLayer]:
        return [l for l in self.layers if l.stage == stage]


def unique_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by their first name (tied weights once), as named_parameters gives them."""
    return dict(model.named_parameters())


def tied_parameter_names(model: nn.Module) -> list[list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _parent(path: str) -> tuple[str, str]:
    parent, _, leaf = path.rpartition(".")
    return parent, leaf


# The containers whose numbered entries can be a block stack: a ModuleList the
# parent walks, or a Sequential that chains them (timm's ViT); a pipeline stage
# swaps entries of either for stand-ins, a split block is the entry itself.
STACKS = (nn.ModuleList, nn.Sequential)


def block_stacks(layer_paths: list[list[str]], modules: dict[str, nn.Module]) -> list[str]:
    """Paths of the nn.ModuleLists (or nn.Sequentials: timm's
    `self.blocks = nn.Sequential(*blocks)`) whose entries are layers (the block stacks,
    at any depth: `blocks`, Hugging Face's `model.layers`, `transformer.h`),
    in the order their layers run. An encoder-decoder has two. Paths that
    are not modules (parameters capture folds into a layer, such as T5's
    encoder final norm) do not count: lowering sees module paths only."""
    containers: dict[str, int] = {}
    for paths in layer_paths:
        paths = [p for p in paths if p in modules]
        if len(paths) == 1:
            parent, leaf = _parent(paths[0])
            # (not the model itself: a root Sequential is the whole model, embeddings and head too)
            if parent and parent in modules and isinstance(modules[parent], STACKS) and leaf.isdigit():
                containers[parent] = containers.get(parent, 0) + 1
    if not containers:
        return []
    stacks = [k for k, n in containers.items() if n >= 2]
    return stacks or [max(containers, key=lambda k: containers[k])]


def resolve(model: nn.Module, plan: Plan) -> ModelLayout:
    if not plan.stages or not plan.layer_choices:
        raise PlanMismatchError("the plan has no stages/layers to lower",
                                hint="make the plan with autopar.plan(...) or `autopar plan ... --json`")
    modules = dict(model.named_modules())
    params = unique_parameters(model)
    layers: list[ResolvedLayer] = []
    for stage in sorted(plan.stages, key=lambda s: s.index):
        for choice in stage.layers:
            paths = list(choice.module_paths) or [choice.name]
            if _root_compute(choice, paths, modules, params):
                paths = []
            for p in paths:
                if p not in modules and p not in params:
                    raise PlanMismatchError(
                        f"the model differs from the planned one: layer {choice.name!r} names module {p!r}, "
                        f"which this model does not have",
                        hint="re-plan for this model (autopar plan), or pass the model the plan was made for")
            layers.append(ResolvedLayer(choice=choice, stage=stage.index, paths=[p for p in paths if p in modules],
                                        param_paths=[p for p in paths if p not in modules]))
    _check_parameters(model, plan, layers)

    stacks = block_stacks([l.paths for l in layers], modules)
    seen_block, n, ends = False, 0, {}
    for l in layers:
        parent, leaf = _parent(l.paths[0]) if len(l.paths) == 1 else ("", "")
        if parent in stacks:
            # Numbered across stacks in execution order (encoder 0..3, decoder 4..7);
            # with one stack this is the index in its ModuleList.
            l.block_index, l.position, l.stack = n, "block", parent
            ends.setdefault(parent, [n, n])[1] = n
            n += 1
            seen_block = True
        else:
            l.position = "post" if seen_block else "pre"
    _check_root_compute(layers)
    return ModelLayout(layers=layers, blocks_path=stacks[0] if len(stacks) == 1 else None,
                       num_blocks=len(modules[stacks[0]]) if len(stacks) == 1 else n,
                       tied=tied_parameter_names(model), stacks=stacks,
                       stack_ends={k: tuple(v) for k, v in ends.items()})


def _root_compute(choice, paths, modules, params) -> bool:
    """A layer of what the model's own forward computes after its modules: the
    loss alone (capture's "output"), or a head the root computes from a weight
    another layer holds (`h @ self.emb.weight.T`). It names itself, not a module
    of this model, and owns no parameter: nothing to place (every parameter of
    the model is still checked against the plan's, so a different model is not
    mistaken for one)."""
    return (paths == [choice.name] and choice.kind in ("head", "other")
            and choice.name not in modules and choice.name not in params)


def _check_root_compute(layers: list[ResolvedLayer]) -> None:
    for i, l in enumerate(layers):
        if l.paths or l.param_paths:
            continue
        # after every layer that holds a module: also a model without a block stack
        # (x-transformers' TransformerWrapper: one layer holds the decoder), where no
        # layer is "post" because none is a block
        after_modules = not any(m.paths or m.param_paths for m in layers[i:])
        if not (l.position == "post" or after_modules) or l.choice.tp_style != "replicate":
            why = ("comes before the model's blocks" if not (l.position == "post" or after_modules)
                   else f"is planned {l.choice.tp_style!r}, but no module holds a weight to split")
            raise PlanMismatchError(
                f"the model differs from the planned one: layer {l.choice.name!r} names no module of this model "
                f"and {why}",
                hint="re-plan for this model (autopar plan), or pass the model the plan was made for")


def _check_parameters(model: nn.Module, plan: Plan, layers: list[ResolvedLayer]) -> None:
    params = unique_parameters(model)
    total = sum(p.numel() for p in params.values())
    planned = plan.model.get("total_params") if isinstance(plan.model, dict) else None
    if planned and int(planned) != total:
        raise PlanMismatchError(
            f"the model differs from the planned one: it has {total:,} parameters, the plan was made for {int(planned):,}",
            hint="re-plan for this model, or load the model the plan was made for")
    shapes = plan.model.get("param_shapes") if isinstance(plan.model, dict) else None
    if shapes:
        for name, shape in shapes.items():
            if name not in params:
                raise PlanMismatchError(f"the model differs from the planned one: parameter {name!r} is missing")
            if list(params[name].shape) != list(shape):
                raise PlanMismatchError(
                    f"the model differs from the planned one: parameter {name!r} has shape "
                    f"{list(params[name].shape)}, the plan says {list(shape)}")
    covered = {p for l in layers for p in l.param_paths}
    for l in layers:
        for p in l.paths:
            prefix = p + "."
            covered.update(n for n in params if n.startswith(prefix))
    loose = sorted(set(params) - covered)
    if loose:
        raise PlanMismatchError(
            f"the model differs from the planned one: parameters not covered by any planned layer: "
            f"{', '.join(loose[:5])}{' ...' if len(loose) > 5 else ''}",
            hint="re-plan for this model so that every parameter belongs to a layer")


def model_signature(model: nn.Module) -> dict:
    """What a plan records about the model so lowering can check it later."""
    params = unique_parameters(model)
    return {"total_params": sum(p.numel() for p in params.values()),
            "param_shapes": {n: list(p.shape) for n, p in params.items()}}
