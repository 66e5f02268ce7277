"""What a user of one training stack alone would run, priced beside the Plan.

`autopar plan` says how much faster its layout is than the one a user of
DeepSpeed or of PyTorch FSDP would set up without autopar (issue 33, item 4).
Each stack is a *family* of layouts, taken from the stack's own documented
practice, and its baseline is the fastest member that fits, priced by the same
cost model, on the same graph, engine, precision, optimizer and memory limit
(headroom included) as the Plan: the ratio measures the layout, not the pricing.
Offloaded layouts count only when no layout of the family fits without offload
(as the planner's own search, which offers offload only then).

- **DeepSpeed** here means ZeRO data parallelism, what `deepspeed.initialize`
  with a `zero_optimization` block runs: ZeRO stage 0, 1, 2 or 3, optimizer
  state offloaded to the CPU (ZeRO-Offload, `offload_optimizer`) or parameters
  too (ZeRO-Infinity, `offload_param`, stage 3 only), activation checkpointing
  of every block or of none (`deepspeed.checkpointing` / Hugging Face's
  gradient checkpointing recompute the whole block: "full"), any
  `train_micro_batch_size_per_gpu` x `gradient_accumulation_steps`; offload
  only when nothing fits without it (DeepSpeed's own advice: offload to fit a
  model, at a cost in speed). No tensor
  or pipeline parallelism: DeepSpeed's pipeline engine (`PipelineModule`) and
  Megatron-DeepSpeed's tensor parallelism exist, but a user who takes them has
  left "DeepSpeed-only" for a 3D layout, which is what autopar searches.
  ZeRO++ is left out: its quantized weights and gradients (qwZ, qgZ) change the
  training numerics, and hpZ's secondary parameter shard inside each node is
  neither priced by cost_models nor run by autopar's lowering, so it could not
  be priced on the same terms as the Plan.
- **FSDP** means PyTorch FSDP2 (`fully_shard`, as torchtitan applies it without
  tensor or pipeline parallelism): full sharding (`reshard_after_forward=True`,
  ZeRO 3) or parameters kept after forward (`reshard_after_forward=False`,
  ZeRO 2, FSDP1's SHARD_GRAD_OP), `CPUOffloadPolicy` (parameters, gradients
  and optimizer state on the CPU) when needed to fit, activation checkpointing
  none, selective (torchtitan's op-level policy: the GEMM and attention outputs
  kept, the rest recomputed, as autopar's `checkpoint_policy`) or full, any
  micro-batch with gradient accumulation. Hybrid sharding (HSDP) is not
  offered: cost_models prices no replicate-across-nodes / shard-inside-nodes
  split, so it could not be priced on the Plan's terms.

Both run every GPU as one data-parallel rank, so dp must divide the global
batch (DeepSpeed checks train_batch_size = micro-batch x accumulation x GPUs).
When the cluster's GPU count does not, the baseline runs on the most GPUs that
do (whole nodes, or part of one) and says so: that too is what the user gets.

Cheap by construction: a fixed handful of uniform layouts per micro-batch size
is priced with `estimate` (no search); on GPT-3 175B / 1,024 GPUs that is a
few dozen estimates of a few milliseconds each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.plan import ACCUMULATE
from autopar.solve.alternatives import layout_summary, predicted_dict
from autopar.solve.refine import fits, price_uniform
from autopar.solve.search_space import Candidate, divisors, whole_batch_reason

GB = 1e9


@dataclass(frozen=True)
class Family:
    """The layouts one stack's user would set up on pure data parallelism."""

    stack: str  # the key in Plan.baselines ("deepspeed", "fsdp")
    name: str  # what the terminal and the report call it
    states: tuple  # (zero, offload) pairs the stack runs, plainest first
    checkpoints: tuple  # uniform activation checkpointing modes it offers
    zero_words: dict  # zero -> the stack's own words for it
    offload_words: dict  # offload -> the stack's own words for it
    checkpoint_words: dict

    def config(self, zero: int, checkpoint: str, offload: str, micro_batch: int, accumulation: int) -> str:
        """The layout in the stack's own configuration words."""
        words = [self.zero_words[zero]] + ([self.offload_words[offload]] if offload != "none" else [])
        words.append(self.checkpoint_words[checkpoint])
        if self.stack == "deepspeed":
            words.append(f"train_micro_batch_size_per_gpu {micro_batch}, gradient_accumulation_steps {accumulation}")
        else:
            words.append(f"micro-batch {micro_batch} x {accumulation} accumulation step{'s' * (accumulation > 1)}")
        return ", ".join(words)


DEEPSPEED = Family(
    stack="deepspeed", name="DeepSpeed ZeRO (data parallel only)",
    states=((0, "none"), (1, "none"), (2, "none"), (3, "none"), (1, "optimizer"), (2, "optimizer"),
            (3, "optimizer"), (3, "params")),
    checkpoints=("none", "full"),
    zero_words={z: f"ZeRO stage {z}" for z in range(4)},
    offload_words={"optimizer": "offload_optimizer cpu (ZeRO-Offload)",
                   "params": "offload_param + offload_optimizer cpu (ZeRO-Infinity)"},
    checkpoint_words={"none": "no activation checkpointing", "full": "activation checkpointing on every block"})
FSDP = Family(
    stack="fsdp", name="PyTorch FSDP2 (data parallel only)",
    states=((2, "none"), (3, "none"), (3, "params")),
    checkpoints=("none", "selective", "full"),
    zero_words={2: "fully_shard(reshard_after_forward=False)", 3: "fully_shard (full shard)"},
    offload_words={"params": "CPUOffloadPolicy"},
    checkpoint_words={"none": "no activation checkpointing", "selective": "selective activation checkpointing",
                      "full": "full activation checkpointing"})
FAMILIES = (DEEPSPEED, FSDP)


def data_parallel_gpus(world: int, global_batch_size: int, gpus_per_node: int) -> int:
    """The most GPUs data parallelism alone can use: dp divides both the GPU count and
    the global batch, and is whole nodes or part of one node."""
    for d in sorted(divisors(math.gcd(world, global_batch_size)), reverse=True):
        if d % gpus_per_node == 0 or gpus_per_node % d == 0:
            return d
    return 1


def family_layouts(family: Family, gpus: int, global_batch_size: int, whole_batch: bool = False):
    """(Candidate, (zero, checkpoint, offload)) of every layout in the family, in a fixed order."""
    per_replica = global_batch_size // gpus
    for mbs in ([per_replica] if whole_batch else divisors(per_replica)):
        cand = Candidate(pp=1, dp=gpus, tp=1, micro_batch_size=mbs, num_micro_batches=per_replica // mbs,
                         schedule=ACCUMULATE)
        for zero, offload in family.states:
            for ckpt in family.checkpoints:
                yield cand, (zero, ckpt, offload)


def price_baselines(spec, cluster, global_batch_size: int, *, precision: str, optimizer: str, limit_bytes: float,
                    plan_step_s: float, cluster_of, families=FAMILIES) -> list[dict]:
    """One dict per family (`Plan.baselines`): its fastest layout that fits, or, when
    none does, the one closest to fitting and why it cannot. `cluster_of(nodes,
    gpus_per_node)`: the same hardware with that many GPUs (the planner's
    `scaled_cluster`; gpus_per_node None: unchanged), used when data parallelism
    alone cannot use every GPU."""
    world = cluster.world_size
    gpus = data_parallel_gpus(world, global_batch_size, cluster.gpus_per_node)
    if gpus != world:
        nodes, per_node = (gpus // cluster.gpus_per_node, None) if gpus >= cluster.gpus_per_node else (1, gpus)
        try:
            cluster = cluster_of(nodes, per_node)
        except AutoparError as exc:  # the comparison never stops a plan
            return [{"stack": f.stack, "name": f.name, "gpus": gpus, "layouts_priced": 0, "fits": False,
                     "status": "none", "vs_plan": None,
                     "why": f"not priced: data parallelism alone runs on {gpus} of the {world} GPUs, and that "
                            f"cluster could not be built ({exc})"} for f in families]
    whole = whole_batch_reason(spec.layers) is not None
    return [_best_of(family, spec, cluster, global_batch_size, precision, optimizer, limit_bytes, plan_step_s,
                     world, whole) for family in families]


def _best_of(family, spec, cluster, global_batch_size, precision, optimizer, limit_bytes, plan_step_s, world,
             whole) -> dict:
    best, closest, priced = None, None, 0
    for cand, option in family_layouts(family, cluster.world_size, global_batch_size, whole):
        _, est = price_uniform(spec, cluster, cand, option, precision=precision, optimizer=optimizer)
        if est is None:
            continue
        priced += 1
        if fits(est, limit_bytes):
            # offload only when nothing fits without it: both stacks document it as the way
            # to fit a model, and the planner searches it only then (table.option_space)
            key = (option[2] != "none", est.step_time_s)
            if best is None or key < (best[1][2] != "none", best[2].step_time_s):
                best = (cand, option, est)
        elif closest is None or max(est.peak_memory_bytes) < max(closest[2].peak_memory_bytes):
            closest = (cand, option, est)
    gpus = cluster.world_size
    out = {"stack": family.stack, "name": family.name, "gpus": gpus, "layouts_priced": priced}
    if best is None and closest is None:
        return {**out, "fits": False, "status": "none", "vs_plan": None,
                "why": f"the cost model priced none of its {family.name} layouts on {gpus} GPUs"}
    cand, (zero, ckpt, offload), est = best or closest
    out.update(layout_summary(cand, [(zero, ckpt, offload)]), offload=offload, fits=best is not None,
               config=family.config(zero, ckpt, offload, cand.micro_batch_size, cand.num_micro_batches),
               predicted=predicted_dict(est))
    fewer = (f"; on {gpus} of the {world} GPUs: data parallelism alone needs dp to divide the global batch "
             f"{global_batch_size}" if gpus != world else "")
    if best is not None:
        ratio = est.step_time_s / plan_step_s if plan_step_s else None
        return {**out, "status": "ok", "vs_plan": ratio,
                "why": f"the fastest that fits of the {priced} {family.name} layouts, priced as the plan is{fewer}"}
    over = (f"needs {max(est.peak_memory_bytes) / GB:.1f} GB on its fullest GPU, over the {limit_bytes / GB:.1f} GB "
            "limit (usable memory less the headroom)" if est.fits else est.why_not_fit)
    return {**out, "status": "oom", "vs_plan": None,
            "why": f"does not fit: none of its {priced} layouts does; the closest ({out['config']}): {over}{fewer}"}
