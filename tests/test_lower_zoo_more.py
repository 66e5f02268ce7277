"""Architectures the lowering matrix lacked, as transformers writes them, on 2 gloo
ranks against one process (fp32, SGD with momentum, 3 steps, 1e-5 relative on every
loss and parameter), or refused on both ranks with the real cause:

  DeBERTa-v2   disentangled attention (relative position embeddings shared by every
               layer); its forward without a mask reads the ids for a padding warning,
               which capture and the lowering's fake-tensor probes skip
  ALBERT       one shared layer applied N times: no block stack, so data parallelism
               and ZeRO-3 run (one stage of every layer) and tp / pp are refused
               naming that
  DBRX         fused experts (one (experts x ffn, hidden) weight per projection) and
               transformers' eager loop over the experts that were hit (capture
               prices it as balanced routing); tp / pp are cut from a fake-tensor
               forward its value-sized nonzero cannot run: refused, never a crash
  x-transformers style
               layers as ModuleLists [norms, attention / MLP, residual] that the
               decoder walks itself (never called: no block forward to cut at, so
               the decoder is one layer, and FSDP2 shards the containers' children),
               autocast switched off by the input's device (on meta at capture)
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import run_world

pytestmark = pytest.mark.slow
VOCAB, BATCH, SEQ, STEPS = 64, 4, 8, 3


def build(arch: str):
    import transformers as T
    torch.manual_seed(0)
    small = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0)
    if arch == "deberta":
        return T.DebertaV2ForMaskedLM(T.DebertaV2Config(**small))
    if arch == "albert":
        return T.AlbertForMaskedLM(T.AlbertConfig(embedding_size=16, **small))
    if arch == "dbrx":
        return T.DbrxForCausalLM(T.DbrxConfig(
            d_model=32, n_heads=4, n_layers=4, max_seq_len=64, vocab_size=VOCAB,
            ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}))
    if arch == "xstyle":
        return XStyleLM()
    raise KeyError(arch)


class _XAttention(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.to_out = nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (f(x).view(b, s, self.heads, -1).transpose(1, 2) for f in (self.to_q, self.to_k, self.to_v))
        with torch.autocast(x.device.type, enabled=False):  # as x-transformers' rotary embedding
            q = q.float() * 1.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(b, s, d))


class _XFeedForward(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return self.ff(x)


class _XResidual(nn.Module):
    def forward(self, out, residual):
        return out + residual


class XStyleLM(nn.Module):
    """x-transformers' TransformerWrapper(Decoder) shape: self.layers[i] = ModuleList([norms, block, residual])."""

    def __init__(self, d=32, depth=4):
        super().__init__()
        self.token_emb = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.ModuleList([nn.LayerNorm(d)]), _XAttention(d) if i % 2 == 0 else _XFeedForward(d),
                           _XResidual()]) for i in range(depth))
        self.final_norm = nn.LayerNorm(d)
        self.to_logits = nn.Linear(d, VOCAB)

    def forward(self, idx):
        x = self.token_emb(idx)
        for norms, block, residual in self.layers:
            x = residual(block(norms[0](x)), x)
        return self.to_logits(self.final_norm(x))


def _ce(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _world(rank, world, cells):
    import autopar
    from lower_worlds import tp_sharded
    from autopar.errors import AutoparError
    from autopar.lower.manual_plan import plan_for_model
    out = {}
    for name, arch, layout in cells:
        model = build(arch)
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]
        ref = copy.deepcopy(model)
        opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        ref_losses = []
        loss_fn = _ce if arch == "xstyle" else None
        for x in batches:
            loss = _ce(ref(x), x) if loss_fn else ref(x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        inputs = lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)  # noqa: E731
        try:
            mb = BATCH // layout.get("dp", 1) // layout.get("num_micro_batches", 1)
            plan = plan_for_model(model, example_inputs=inputs, micro_batch_size=mb, **layout)
            pm = autopar.compile(model, plan=plan, example_inputs=inputs, loss_fn=loss_fn, optimizer=torch.optim.SGD,
                                 optimizer_kwargs=dict(lr=0.1, momentum=0.9))
            losses = [pm.train_step(x, x) for x in batches]
        except AutoparError as exc:
            out[name] = {"refused": str(exc)}
            continue
        state = pm.full_state_dict()
        out[name] = {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     # floor 1e-3 as the lowering matrix: a parameter at ~0 (DeBERTa's) is no scale
                     "param_err": max(float((state[k] - p.detach()).abs().max()
                                            / p.detach().abs().max().clamp_min(1e-3)) for k, p in ref.named_parameters()),
                     "tp_sharded": tp_sharded(pm)}
    return out


CELLS = [
    ("deberta_dp", "deberta", dict(dp=2)),
    ("deberta_tp", "deberta", dict(tp=2)),
    ("deberta_pp", "deberta", dict(pp=2, num_micro_batches=2)),
    ("albert_dp", "albert", dict(dp=2)),
    ("albert_zero3", "albert", dict(dp=2, zero=3)),
    ("albert_tp", "albert", dict(tp=2)),
    ("albert_pp", "albert", dict(pp=2, num_micro_batches=2)),
    ("dbrx_dp", "dbrx", dict(dp=2)),
    ("dbrx_zero3", "dbrx", dict(dp=2, zero=3)),
    ("dbrx_tp", "dbrx", dict(tp=2)),
    ("dbrx_pp", "dbrx", dict(pp=2, num_micro_batches=2)),
    ("xstyle_dp", "xstyle", dict(dp=2)),
    ("xstyle_zero3", "xstyle", dict(dp=2, zero=3)),
    ("xstyle_pp", "xstyle", dict(pp=2, num_micro_batches=2)),
]


@pytest.mark.timeout(600)
def test_deberta_and_albert_train_as_one_process_or_are_refused_with_the_cause():
    results = run_world(_world, 2, CELLS, timeout=540)
    for name, *_ in CELLS:
        assert results[0][name].get("refused") == results[1][name].get("refused"), name
    r = results[0]
    for name in ("deberta_dp", "deberta_tp", "deberta_pp", "albert_dp", "albert_zero3", "dbrx_dp", "dbrx_zero3",
                 "dbrx_pp", "xstyle_dp", "xstyle_zero3"):
        assert "refused" not in r[name], (name, r[name])
        assert r[name]["loss_err"] < 1e-5 and r[name]["param_err"] < 1e-5, (name, r[name])
    # tp splits DeBERTa's blocks, not only its embeddings
    assert any(".encoder.layer.0." in k for k in r["deberta_tp"]["tp_sharded"]), r["deberta_tp"]["tp_sharded"]
    assert "no repeated blocks" in r["albert_tp"]["refused"] and "tensor parallelism" in r["albert_tp"]["refused"]
    assert "no repeated blocks" in r["albert_pp"]["refused"] and "pipeline" in r["albert_pp"]["refused"]
    assert "pipeline stages" in r["xstyle_pp"]["refused"]
    # the expert loop's nonzero: the probes answer it (pp runs), DTensor's sharding cannot
    assert "Sharding propagation failed for aten.nonzero" in r["dbrx_tp"]["refused"], r["dbrx_tp"]


def test_dbrx_captures_its_expert_loop_as_balanced_routing_and_plans_no_tensor_parallelism():
    import autopar
    model = build("dbrx")
    inputs = lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)  # noqa: E731
    graph = autopar.capture(model, inputs)
    block = next(l for l in graph.layers if l.kind == "moe_block")
    b, s = 2, SEQ
    # q (32) + k, v (2 kv heads x 8) projections, output projection, attention, router,
    # and the experts: rows x top-2 assignments, each three 32 x 64 GEMMs
    rows = b * s
    expected = (2 * rows * 32 * 64 + 2 * rows * 32 * 32 + 4 * b * 4 * s * s * 8 + 2 * rows * 32 * 4
                + rows * 2 * 3 * 2 * 32 * 64)
    assert block.eval("fwd_flops", b, s) == expected
    plan = autopar.plan(model, autopar.ClusterSpec(gpus=4, device="cpu"), example_inputs=inputs,
                        global_batch_size=8, precision="fp32")
    assert plan.mesh.tp == 1


def test_x_transformers_style_layers_capture_as_one_priced_layer_and_the_planner_plans_dp():
    """Capture on meta with an autocast region; the never-called layer containers are not
    blocks (before, every op landed in the embedding layer and the blocks were priced at 0)."""
    import autopar
    model = XStyleLM()
    inputs = lambda b: (torch.zeros(b, SEQ, dtype=torch.long),)  # noqa: E731
    graph = autopar.capture(model, inputs, loss_fn=_ce)
    flops = {l.name: l.eval("fwd_flops", 2, SEQ) for l in graph.layers}
    # each attention / MLP is its own priced layer, and no layer holds another's work
    assert flops["layers.0.1"] > 0 and flops["layers.1.1"] > 0 and flops["layers.2.1"] == flops["layers.0.1"]
    assert flops.get("token_emb", 0) < min(flops["layers.0.1"], flops["layers.1.1"])
    plan = autopar.plan(model, autopar.ClusterSpec(gpus=2, device="cpu"), example_inputs=inputs,
                        global_batch_size=4, precision="fp32")
    assert (plan.mesh.pp, plan.mesh.tp) == (1, 1)
    # a hand plan asking for tp names what is missing, not a divisibility it never had
    from autopar.errors import PlanMismatchError
    from autopar.lower.manual_plan import plan_for_model
    with pytest.raises(PlanMismatchError, match="nothing in it tensor parallelism splits"):
        plan_for_model(model, example_inputs=inputs, tp=2)
