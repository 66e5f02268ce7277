"""Rank functions for the lowering tests (importable by spawned ranks).

Each function runs many layouts inside one spawned world (spawning costs
seconds) and returns plain numbers; the tests assert on them.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import torch

from autopar.lower import compile, plan_for_model

SEQ = 16
GLOBAL_BATCH = 8
GPT_TINY_SPEC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                             "gpt.py") + ":gpt_tiny"
STEPS = 3


def build(model_name: str, seed: int = 0, device=None):
    """(model, example_inputs, loss_fn); Hugging Face models ("hf_*") come
    with loss_fn None: autopar uses the model's own loss."""
    import gpt
    import llama
    torch.manual_seed(seed)
    if model_name.startswith("hf_"):
        model = hf_model(model_name)
        return model, lambda b: (torch.zeros(b, SEQ, dtype=torch.long),), None
    factory = {"gpt": gpt.gpt_tiny, "llama": llama.llama_tiny, "llama_tied": _llama_tied}[model_name]
    model, example = factory()
    return model, example, gpt.loss_fn


HF_VOCAB = 512


def hf_model(name: str):
    """Tiny transformers models as users build them (no dropout, so one
    process and many ranks compute the same numbers)."""
    import transformers as tf
    common = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    if name == "hf_llama":  # GQA, RoPE, untied head, blocks at model.layers
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if name == "hf_llama_tied":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=True))
    if name == "hf_mistral":  # sliding-window attention config, same block layout
        return tf.MistralForCausalLM(tf.MistralConfig(**common, sliding_window=None))
    if name == "hf_qwen2":  # biases on q/k/v
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False))
    if name in ("hf_gpt2", "hf_gpt2_odd_vocab"):  # Conv1D (in, out) weights, fused qkv, tied head, transformer.h
        # odd vocab: like GPT-2's 50257, no tp degree divides it
        vocab = HF_VOCAB + 3 if name == "hf_gpt2_odd_vocab" else HF_VOCAB
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=4, n_head=4,
                                                n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                                attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    raise KeyError(name)


def _llama_tied():
    import llama
    cfg = dataclasses.replace(llama.PRESETS["llama_tiny"], tie_embeddings=True)
    return llama.Llama(cfg), lambda b: llama.example_inputs(b, cfg)


def batches(seed: int = 123, vocab: int = 128):
    """STEPS global batches of (inputs, targets); vocab 128 fits every model here."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(STEPS)]


def make_optimizer(kind):
    if kind == "sgd":
        return torch.optim.SGD, {"lr": 0.5, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}


def padding_mask(x: torch.Tensor) -> torch.Tensor:
    """A left-padding attention mask: sample i has i % 4 padded positions."""
    mask = torch.ones_like(x)
    for i in range(x.shape[0]):
        mask[i, :i % 4] = 0
    return mask


def padded_labels(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Labels with padded positions ignored (-100), as users train on padded
    batches: micro-batches then score different numbers of tokens."""
    return y.masked_fill(padding_mask(x) == 0, -100)


def reference(model_name: str, optim: str, attention_mask: bool = False):
    model, _, loss_fn = build(model_name)
    cls, kw = make_optimizer(optim)
    opt = cls(model.parameters(), **kw)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        # Hugging Face models: their own loss, the way users train them
        if loss_fn is not None:
            loss = loss_fn(model(x), y)
        elif attention_mask:
            loss = model(x, attention_mask=padding_mask(x), labels=padded_labels(x, y)).loss
        else:
            loss = model(x, labels=y).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def sgd_reference(model, batches, loss=lambda m, x: m(x, labels=x).loss):
    """A copy of `model` trained in one process on `batches` with SGD (lr 0.1,
    momentum 0.9, as the architecture worlds train): (trained copy, losses)."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in batches:
        value = loss(ref, x)
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return ref, losses


def train_planned(model, example_inputs, batches, layout: dict, micro_batch_size: int, loss_fn=None):
    """(ParallelModel, losses): `model` lowered on a hand plan of `layout` and
    trained on `batches` (targets = inputs) like `sgd_reference`."""
    import autopar
    from autopar.lower.manual_plan import plan_for_model
    plan = plan_for_model(model, example_inputs=example_inputs, micro_batch_size=micro_batch_size, **layout)
    pm = autopar.compile(model, plan=plan, example_inputs=example_inputs, loss_fn=loss_fn,
                         optimizer=torch.optim.SGD, optimizer_kwargs=dict(lr=0.1, momentum=0.9))
    return pm, [pm.train_step(x, x) for x in batches]


def compare(params, ref_params) -> float:
    """Largest per-tensor relative difference max|p - ref| / max|ref|."""
    assert set(params) == set(ref_params), (sorted(params), sorted(ref_params))
    worst = 0.0
    for k, ref in ref_params.items():
        worst = max(worst, ((params[k] - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item())
    return worst


def equivalence_world(rank, world, model_name, layouts, optim):
    """For each layout (kwargs of plan_for_model, plus an optional "model"
    overriding model_name, and "attention_mask": True to feed a Hugging Face
    model a padding mask as its second input and -100 labels at the padded
    positions): losses per step and the worst
    relative parameter difference against one process after STEPS steps."""
    refs = {}
    out = {}
    for name, kw in layouts:
        kw = dict(kw)
        this_model = kw.pop("model", model_name)
        masked = kw.pop("attention_mask", False)
        if (this_model, masked) not in refs:
            refs[(this_model, masked)] = reference(this_model, optim, masked)
        ref_losses, ref_params = refs[(this_model, masked)]
        model, example, loss_fn = build(this_model)
        if masked:
            example = lambda b: (torch.zeros(b, SEQ, dtype=torch.long), torch.ones(b, SEQ, dtype=torch.long))
        if "plan_json" in kw:  # a plan made elsewhere (the solver, `autopar compile`)
            from autopar.plan import Plan
            plan = Plan.load(kw["plan_json"])
        else:
            dp = kw.get("dp", 1)
            n_mb = kw.setdefault("num_micro_batches", 1)
            kw.setdefault("micro_batch_size", GLOBAL_BATCH // (dp * n_mb))
            plan = plan_for_model(model, example_inputs=example, **kw)
        cls, okw = make_optimizer(optim)
        pm = compile(model, example_inputs=example, loss_fn=loss_fn, optimizer=cls, optimizer_kwargs=okw,
                     plan=plan)
        between = _watch_second_block(model, plan)
        losses = [pm.train_step((x, padding_mask(x)), padded_labels(x, y)) if masked else pm.train_step((x,), y)
                  for x, y in batches()]
        state = pm.full_state_dict()
        out[name] = {"losses": losses, "ref_losses": ref_losses,
                     "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "param_rel": compare(state, ref_params), "loss_parallel": pm.loss_parallel,
                     "tp_sharded": tp_sharded(pm), "notes": pm.notes,
                     "seq_between_blocks": between.get("seq"), "optimizer_state_share": optimizer_state_share(pm),
                     "outputs_kept": outputs_kept(pm)}
    return out


def outputs_kept(pm) -> int:
    """Micro-batch outputs the pipeline stages still hold after a step (the schedule
    keeps each for merging unless told not to: the logits of every micro-batch)."""
    sched = pm.schedule
    if sched is None:
        return 0
    stages = getattr(sched, "_stages", None) or [sched._stage]
    return sum(len(s.output_chunks) for s in stages)


def _watch_second_block(model, plan) -> dict:
    """The sequence length this rank holds in the activation the second
    block hands on (local shard: seq / tp under sequence parallelism), from a
    forward hook: proof that sequence parallelism is on, not only planned."""
    seen: dict = {}
    blocks = [c for c in plan.layer_choices if c.kind not in ("embedding", "head") and len(c.module_paths) == 1]
    if len(blocks) < 3:
        return seen

    def hook(module, args, output):
        t = output[0] if isinstance(output, (tuple, list)) else output
        t = getattr(t, "_local_tensor", t)
        seen.setdefault("seq", int(t.shape[1]))
    model.get_submodule(blocks[1].module_paths[0]).register_forward_hook(hook)
    return seen


def optimizer_state_share(pm) -> float:
    """Share of the model's parameter elements whose optimizer state this
    rank holds: 1 when replicated, 1/dp when ZeRO shards it (ZeRO-1's
    ZeroRedundancyOptimizer keeps this rank's shard in `.optim`)."""
    from torch.distributed.tensor import DTensor
    opt = getattr(pm.optimizer, "optim", pm.optimizer)
    local = lambda p: (p._local_tensor if isinstance(p, DTensor) else p).numel()  # noqa: E731
    held = sum(local(p) for p, st in opt.state.items() if st)
    total = sum(p.numel() for p in {id(p): p for g in pm.optimizer.param_groups for p in g["params"]}.values())
    if pm.plan.mesh.pp > 1 or pm.plan.mesh.tp > 1:
        return float("nan")  # other ranks hold other stages / tp shards: not comparable
    return held / total


def tp_sharded(pm) -> list[str]:
    """Names of the parameters this rank holds sharded over the tp mesh axis:
    proof that tensor parallelism split them (equal numbers alone could also
    come from a replicated model)."""
    from torch.distributed.tensor import DTensor, Shard
    if pm.plan.mesh.tp == 1:
        return []
    out = []
    for name, p in pm._local_params().items():
        if isinstance(p, DTensor):
            tp_dim = p.device_mesh.mesh_dim_names.index("tp") if "tp" in (p.device_mesh.mesh_dim_names or ()) else None
            if tp_dim is not None and isinstance(p.placements[tp_dim], Shard):
                out.append(name)
    return sorted(out)


def world_size_mismatch_world(rank, world):
    """A plan for 2x the ranks must fail on every rank with a message, not hang."""
    from autopar.errors import PlanMismatchError
    model, example, loss_fn = build("gpt")
    plan = plan_for_model(model, dp=world * 2)
    try:
        compile(model, example_inputs=example, loss_fn=loss_fn, plan=plan)
    except PlanMismatchError as exc:
        return str(exc)
    return None


def _meta_gpt():
    import gpt
    cfg = gpt.GPTConfig(vocab_size=1024, seq_len=32, hidden=128, layers=4, heads=4)
    with torch.device("meta"):
        model = gpt.GPT(cfg)

    def init_fn(module):
        # the model's own init (GPT._init_weights) plus its position buffer
        model._init_weights(module)
        if isinstance(module, gpt.GPT):
            module.pos.copy_(torch.arange(cfg.seq_len))
    return model, cfg, init_fn


def meta_memory_world(rank, world):
    """Meta model -> shards: bytes of parameters each rank holds vs the whole
    model, init statistics, tied ends equal, and that it trains."""
    import torch.distributed as dist
    import gpt
    out = {}
    layouts = [("zero3_dp4", dict(dp=4, zero=3), 4), ("tp4", dict(tp=4), 4),
               ("pp2_dp2_zero3", dict(pp=2, dp=2, zero=3, schedule="gpipe", num_micro_batches=2), 4)]
    for name, kw, factor in layouts:
        model, cfg, init_fn = _meta_gpt()
        full_bytes = sum(p.numel() * 4 for p in model.parameters())
        kw.setdefault("micro_batch_size", 8 // (kw.get("dp", 1) * kw.get("num_micro_batches", 1)))
        plan = plan_for_model(model, **kw)
        example = lambda b: (torch.zeros(b, cfg.seq_len, dtype=torch.long),)
        pm = compile(model, example_inputs=example, loss_fn=gpt.loss_fn, plan=plan,
                     optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, init_fn=init_fn)
        local = pm.local_parameter_bytes()
        # the tied ends: every rank reports the full value of the copies it holds
        tied = {}
        for mod, attr in pm._holders["wte.weight"]:
            if id(mod) in {id(m) for s in pm.stages for m in s.modules()}:
                p = getattr(mod, attr)
                tied[attr] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        everyone = [None] * world
        dist.all_gather_object(everyone, tied)
        copies = [t for d in everyone for t in d.values()]
        state = pm.full_state_dict()
        g = torch.Generator().manual_seed(7)
        x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), generator=g)
        losses = [pm.train_step((x,), torch.roll(x, -1, 1)) for _ in range(2)]
        out[name] = {"local_bytes": local, "full_bytes": full_bytes, "factor": factor,
                     "w_std": state["blocks.0.attn.qkv.weight"].std().item(),
                     "tied_max_diff": max((c - copies[0]).abs().max().item() for c in copies),
                     "losses": losses}
    return out


def emitted_reference_world(rank, world, build_dir, steps):
    """What the emitted train.py computes (--synthetic, the model's meta build, AdamW at 3e-4 without weight
    decay, a constant schedule), done by compiling in this process and feeding every
    rank the whole global batch (train.py reads only each dp rank's share)."""
    import os
    from autopar.model_file import load_model
    from autopar.plan import Plan
    from autopar.train.data import GlobalBatches, Synthetic
    plan = Plan.load(os.path.join(build_dir, "plan.json"))
    torch.manual_seed(0)
    # As train.py builds it (--init auto): meta parameters, initialised shard by shard.
    loaded = load_model(os.path.join(build_dir, "model.py") + ":gpt_tiny", device="meta-params")
    pm = compile(loaded.model, example_inputs=loaded.example_inputs, loss_fn=loaded.loss_fn,
                 optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 3e-4, "weight_decay": 0.0}, plan=plan)
    data = GlobalBatches(Synthetic(loaded.example_inputs, seed=0), plan.global_batch_size, 1, 0, seed=0)
    return [pm.train_step(*data.batch(s)) for s in range(steps)]


def precision_world(rank, world):
    """bf16 plans: FSDP2 MixedPrecisionPolicy (dp) and autocast (tp, no FSDP)."""
    ref_losses, _ = reference("llama", "sgd")
    out = {}
    for name, kw in [("dp_zero2_bf16", dict(dp=2, zero=2, micro_batch_size=4)),
                     ("tp_bf16", dict(tp=2, micro_batch_size=8))]:
        model, example, loss_fn = build("llama")
        plan = plan_for_model(model, precision="bf16", **kw)
        cls, okw = make_optimizer("sgd")
        pm = compile(model, example_inputs=example, loss_fn=loss_fn, optimizer=cls, optimizer_kwargs=okw, plan=plan)
        losses = [pm.train_step((x,), y) for x, y in batches()]
        out[name] = {"losses": losses, "ref_losses": ref_losses,
                     "param_dtype": str(next(iter(pm.full_state_dict().values())).dtype)}
    return out


def autoplan_world(rank, world):
    """compile(plan=None): rank 0 plans (the solver), every rank lowers that plan."""
    import hashlib
    from autopar.solve.planner import scaled_cluster
    from cost_models.hardware import ClusterSpec
    ref_losses, _ = reference("gpt", "sgd")
    model, example, loss_fn = build("gpt")
    cluster = scaled_cluster(ClusterSpec.resolve("cpu"), 1, world)
    cls, okw = make_optimizer("sgd")
    pm = compile(model, cluster, example_inputs=example, global_batch_size=GLOBAL_BATCH, loss_fn=loss_fn,
                 optimizer=cls, optimizer_kwargs=okw, constraints={"pp": 1})
    losses = [pm.train_step((x,), y) for x, y in batches()]
    return {"plan_sha": hashlib.sha256(pm.plan.to_json().encode()).hexdigest(), "losses": losses,
            "ref_losses": ref_losses, "precision": pm.plan.precision,
            "mesh": (pm.plan.mesh.pp, pm.plan.mesh.dp, pm.plan.mesh.tp)}


def two_rank_runtime_world(rank, world):
    """The 2-rank runtime checks in one spawn: a plan for the wrong world
    size, bf16 plans, and compile(plan=None)."""
    import traceback
    out = {"mismatch": world_size_mismatch_world(rank, world), "precision": precision_world(rank, world)}
    try:  # the planner is another stage: its failure must not hide the checks above
        out["autoplan"] = autoplan_world(rank, world)
    except Exception:
        out["autoplan"] = {"error": traceback.format_exc()}
    return out


def hf_meta_world(rank, world):
    """Hugging Face models built on the meta device: each rank allocates its
    shards only and the model's own _init_weights initialises them (weights,
    norms, RoPE inv_freq buffers) without the user passing init_fn."""
    import torch.distributed as dist
    out = {}
    for name, kw in [("hf_llama_tp_sp", dict(tp=2, sequence_parallel=True)), ("hf_gpt2_zero3", dict(dp=2, zero=3)),
                     ("hf_llama_pp", dict(pp=2, schedule="gpipe", num_micro_batches=2))]:
        model_name = "hf_gpt2" if "gpt2" in name else "hf_llama"
        real = hf_model(model_name)
        with torch.device("meta"):
            model = hf_model(model_name)
        full_bytes = sum(p.numel() * 4 for p in model.parameters())
        dp = kw.get("dp", 1)
        plan = plan_for_model(model, micro_batch_size=GLOBAL_BATCH // (dp * kw.get("num_micro_batches", 1)), **kw)
        pm = compile(model, example_inputs=lambda b: (torch.zeros(b, SEQ, dtype=torch.long),), loss_fn=None,
                     plan=plan, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
        state = pm.full_state_dict()
        buffers = {n: b for s in pm.stages for n, b in s.model.named_buffers() if "inv_freq" in n}
        real_buffers = dict(real.named_buffers())
        x = batches()[0][0]
        out[name] = {
            "local_bytes": pm.local_parameter_bytes(), "full_bytes": full_bytes,
            "linear_std": {k: v.std().item() for k, v in state.items() if k.endswith(("q_proj.weight", "c_fc.weight"))},
            "norms_are_ones": all(bool((v == 1).all()) for k, v in state.items() if "norm" in k or ".ln_" in k
                                  if k.endswith("weight")),
            "inv_freq_ok": all(torch.equal(b, real_buffers[n]) for n, b in buffers.items()) if buffers else None,
            "losses": [pm.train_step((x,), x) for _ in range(2)]}
        dist.barrier()
    return out


def hf_precision_world(rank, world):
    """bf16 plans on Hugging Face models (FSDP2 mixed precision: bf16 compute,
    fp32 master weights and reductions) against fp32 single-process training."""
    out = {}
    for name, model_name, kw in [("llama_tp_sp_bf16", "hf_llama", dict(tp=2, sequence_parallel=True)),
                                 ("gpt2_pp_bf16", "hf_gpt2", dict(pp=2, schedule="1f1b", num_micro_batches=2))]:
        ref_losses, _ = reference(model_name, "sgd")
        model, example, loss_fn = build(model_name)
        plan = plan_for_model(model, precision="bf16",
                              micro_batch_size=GLOBAL_BATCH // kw.get("num_micro_batches", 1), **kw)
        cls, okw = make_optimizer("sgd")
        pm = compile(model, example_inputs=example, loss_fn=loss_fn, optimizer=cls, optimizer_kwargs=okw, plan=plan)
        losses = [pm.train_step((x,), y) for x, y in batches()]
        out[name] = {"losses": losses, "ref_losses": ref_losses,
                     "param_dtype": str(next(iter(pm.full_state_dict().values())).dtype)}
    return out


def _clip_reference(model_name, token_file, clip, steps, wd=0.1):
    """One process as people write the loop: AdamW with biases and norm gains undecayed,
    warmup + cosine LambdaLR, torch's clip_grad_norm_, the whole global batch k."""
    from autopar.train.data import GlobalBatches, TokenFile
    from autopar.train.schedule import lr_scheduler
    model, _, loss_fn = build(model_name)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2]},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-2, weight_decay=wd)
    sched = lr_scheduler(opt, warmup=1, total=steps, decay="cosine")
    data = GlobalBatches(TokenFile(token_file, SEQ), GLOBAL_BATCH, 1, 0, seed=7)
    losses, norms = [], []
    for step in range(steps):
        (x,), y = data.batch(step)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


def training_runtime_world(rank, world, token_file, layouts, clip=0.05, steps=4):
    """autopar.train's pieces on several layouts against `_clip_reference`: each dp rank
    reads only its share of global batch k (local_batch), clipping by the global norm over
    every dp / tp / pp shard, the schedule, weight-decay groups. Losses, the gradient norm
    before clipping at every step, and the parameters after `steps` steps."""
    from autopar.train.data import GlobalBatches, TokenFile
    from autopar.train.schedule import lr_scheduler
    out, refs = {}, {}
    for name, kw in layouts:
        kw = dict(kw)
        model_name = kw.pop("model", "llama")
        if model_name not in refs:
            refs[model_name] = _clip_reference(model_name, token_file, clip, steps)
        ref_losses, ref_norms, ref_params = refs[model_name]
        model, example, loss_fn = build(model_name)
        dp = kw.get("dp", 1)
        n_mb = kw.setdefault("num_micro_batches", 1)
        kw.setdefault("micro_batch_size", GLOBAL_BATCH // (dp * n_mb))
        plan = plan_for_model(model, example_inputs=example, **kw)
        pm = compile(model, example_inputs=example, loss_fn=loss_fn, optimizer=torch.optim.AdamW,
                     optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1}, plan=plan, local_batch=True,
                     no_weight_decay_1d=True)
        pm.max_grad_norm = clip
        pm.lr_scheduler = lr_scheduler(pm.optimizer, warmup=1, total=steps, decay="cosine")
        data = GlobalBatches(TokenFile(token_file, SEQ), GLOBAL_BATCH, plan.mesh.dp, pm.dp_rank, seed=7)
        losses, norms = [], []
        for step in range(steps):
            inputs, targets = data.batch(step)
            losses.append(pm.train_step(inputs, targets))
            norms.append(pm.last_grad_norm)
        out[name] = {"loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "norm_rel": max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
                     "norms": norms, "ref_norms": ref_norms,
                     "param_rel": compare(pm.full_state_dict(), ref_params)}
    return out


FP16_LR = 0.05


def _fp16_reference(model_name, token_file, steps, init_scale, growth_interval, inf_at):
    """One process, fp16 as people wrote it before bf16 (apex O2 / Megatron): an fp16
    copy of fp32 master weights runs forward and backward on the scaled loss; its
    gradients, in fp32, are unscaled; an Inf or NaN anywhere (or step `inf_at`) skips
    the step and halves the scale, `growth_interval` clean steps in a row double it."""
    from autopar.train.data import GlobalBatches, TokenFile
    master, _, loss_fn = build(model_name)
    work = copy.deepcopy(master).half()
    # Plain SGD: Adam's normalised step and heavy momentum turn fp16 rounding into whole
    # steps (0.23 apart between one batch and two halves of it, measured), SGD keeps it 7e-5.
    opt = torch.optim.SGD(master.parameters(), lr=FP16_LR)
    data = GlobalBatches(TokenFile(token_file, SEQ), GLOBAL_BATCH, 1, 0, seed=7)
    scale, clean, out = init_scale, 0, {"losses": [], "scales": [], "skipped": []}
    for step in range(steps):
        (x,), y = data.batch(step)
        with torch.no_grad():
            for w, m in zip(work.parameters(), master.parameters()):
                w.copy_(m)
                w.grad = None
        loss = loss_fn(work(x), y)
        (loss.float() * scale).backward()
        grads = [w.grad.float() / scale for w in work.parameters()]
        skip = step == inf_at or not all(bool(torch.isfinite(g).all()) for g in grads)
        out["losses"].append(loss.item())
        out["scales"].append(scale)
        out["skipped"].append(skip)
        if skip:
            scale, clean = scale / 2, 0
            continue
        clean += 1
        if clean == growth_interval:
            scale, clean = scale * 2, 0
        for m, g in zip(master.parameters(), grads):
            m.grad = g
        opt.step()
    out["params"] = {k: v.detach().clone() for k, v in master.named_parameters()}
    return out


def _poison_one_gradient(pm, step: int, when: int) -> None:
    """At step `when`, the last rank (only) finds an Inf in one of its gradient shards
    after backward: every rank must skip that step."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    if step != when or dist.get_rank() != dist.get_world_size() - 1:
        return
    p = next(p for p in pm.parameters() if p.grad is not None)
    local = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
    local.view(-1)[0] = float("inf")


def fp16_world(rank, world, token_file, layouts, steps, init_scale, growth_interval=3, inf_at=2):
    """fp16 plans (fp16 compute over fp32 master shards, the LossScaler over the world)
    against `_fp16_reference`: the same steps skipped on every rank (natural overflow,
    and an Inf on one rank only), the same scales, losses and parameters to fp16's precision."""
    from autopar.train.data import GlobalBatches, TokenFile
    ref = _fp16_reference("llama", token_file, steps, init_scale, growth_interval, inf_at)
    out = {}
    for name, kw in layouts:
        kw = dict(kw)
        model, example, loss_fn = build("llama")
        dp = kw.get("dp", 1)
        n_mb = kw.setdefault("num_micro_batches", 1)
        kw.setdefault("micro_batch_size", GLOBAL_BATCH // (dp * n_mb))
        plan = plan_for_model(model, example_inputs=example, precision="fp16", **kw)
        pm = compile(model, example_inputs=example, loss_fn=loss_fn, optimizer=torch.optim.SGD,
                     optimizer_kwargs={"lr": FP16_LR}, plan=plan, local_batch=True)
        pm.grad_scaler.configure(init_scale=init_scale, growth_interval=growth_interval)
        sync = pm._sync_tied_grads  # runs after backward, before the scaler unscales
        data = GlobalBatches(TokenFile(token_file, SEQ), GLOBAL_BATCH, plan.mesh.dp, pm.dp_rank, seed=7)
        losses, scales, skipped = [], [], []
        for step in range(steps):
            pm._sync_tied_grads = lambda step=step: (sync(), _poison_one_gradient(pm, step, inf_at))
            inputs, targets = data.batch(step)
            scales.append(pm.grad_scaler.scale_value())
            losses.append(pm.train_step(inputs, targets))
            skipped.append(pm.last_step_skipped)
        out[name] = {"losses": losses, "scales": scales, "skipped": skipped,
                     "loss_rel": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
                     "param_rel": compare(pm.full_state_dict(), ref["params"])}
    out["ref"] = {k: v for k, v in ref.items() if k != "params"}
    return out


def batchnorm_world(rank, world, plan_path):
    """ResNet (BatchNorm) on its planned dp 2 FSDP layout in bf16 and in fp32: BatchNorm
    runs with fp32 weights inside bf16 layers (its own FSDP unit), the first loss is the
    fp32 run's to bf16 rounding, and the running statistics are the same on every rank."""
    import resnet
    from autopar.plan import Plan
    plan = Plan.load(plan_path)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    out = {}
    for precision in ("bf16", "fp32"):
        torch.manual_seed(0)
        model, example = resnet.resnet_tiny()
        seen = {}
        model.bn1.register_forward_hook(lambda m, i, o: seen.update(weight=str(m.weight.dtype), out=str(o.dtype)))
        model.conv1.register_forward_hook(lambda m, i, o: seen.update(conv=str(m.weight.dtype)))
        pm = compile(model, example_inputs=example, loss_fn=resnet.loss_fn, optimizer=torch.optim.SGD,
                     optimizer_kwargs={"lr": 0.01}, plan=dataclasses.replace(plan, precision=precision))
        losses = [pm.train_step((x,), y) for x, y in data]
        stats = torch.cat([b.reshape(-1) for n, b in model.named_buffers() if "running_" in n])
        out[precision] = {"losses": losses, "dtypes": seen, "stats": stats.tolist()}
    return out


def meta_init_world(rank, world, layouts):
    """gpt_tiny built on the meta device and lowered on several layouts: every layout
    ends with the same weights, bit for bit, as one process initialising the same
    meta model module by module (materialize.init_module_tree, the run's seed 0)."""
    import gpt
    from autopar.lower.materialize import init_module_tree
    from autopar.lower.model_io import default_init_fn
    from autopar.model_file import load_model, parameters_on_meta
    with parameters_on_meta():  # buffers (GPT's position ids) real, as train.py builds
        ref, _ = gpt.gpt_tiny()
    pos = ref.pos.clone()
    ref.to_empty(device="cpu")  # (which unties the head from the embedding: tie again)
    ref.pos.copy_(pos)
    ref.lm_head.weight = ref.wte.weight
    init_module_tree([ref], default_init_fn(ref), seed=0)
    expected = {k: v.detach().clone() for k, v in ref.named_parameters()}
    out = {}
    for name, kw in layouts:
        torch.manual_seed(0)
        loaded = load_model(GPT_TINY_SPEC, device="meta-params")  # as train.py builds it
        model, example = loaded.model, loaded.example_inputs
        plan = plan_for_model(model, example_inputs=example, **kw)
        pm = compile(model, example_inputs=example, loss_fn=gpt.loss_fn, plan=plan, optimizer=torch.optim.SGD,
                     optimizer_kwargs={"lr": 0.1})
        full = pm.full_state_dict()
        w = full["blocks.0.mlp.fc.weight"]
        out[name] = {"equal": sorted(full) == sorted(expected) and all(torch.equal(full[k], expected[k])
                                                                        for k in expected),
                     "std": w.std().item(), "halves_differ": not torch.equal(w[:w.shape[0] // 2], w[w.shape[0] // 2:]),
                     "pos": [b.tolist() for s in pm.stages for n, b in s.model.named_buffers() if n == "pos"],
                     "differ": sorted(k for k in full if not torch.equal(full[k], expected[k]))[:6],
                     "tied": [s.model.lm_head.weight is s.model.wte.weight for s in pm.stages]}
    return out


def issued_collectives_world(rank, world, model_name):
    """The collectives one training step of a tp=`world` plan issues on real gloo
    ranks, by c10d op (torch's profiler: independent of autopar's own counter)."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    model, example, loss_fn = build(model_name)
    plan = plan_for_model(model, example_inputs=example, tp=world, micro_batch_size=GLOBAL_BATCH)
    pm = compile(model, example_inputs=example, loss_fn=loss_fn, plan=plan)
    x, y = next(iter(batches()))
    pm.train_step((x,), y)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pm.train_step((x,), y)
    counts = collections.Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
    return dict(counts)
