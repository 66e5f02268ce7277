"""Plan fixtures for the report tests (hand-built, shaped like the solver's output).

The numbers are made-up but self-consistent (tokens/s = batch x seq / step,
memory parts sum to the peaks, stage times sum to the compute time) so the
report's hand-check rows have something true to check. They are test data,
never quoted as predictions.
"""
from __future__ import annotations

from autopar.plan import LayerChoice, Mesh, Plan, Predicted, Stage

GiB = 2**30


def make_plan(*, name="gpt3_175b", nodes=128, gpus_per_node=8, pp=16, dp=8, tp=8,
              schedule="1f1b", virtual_stages=1, micro_batch_size=1, num_micro_batches=192,
              num_blocks=96, seq_len=2048, layer_name="blocks.{i}", module_name=None,
              capacity=76 * GiB, device="a100-80g", with_alternatives=True, total_params=174_600_000_000) -> Plan:
    """A plan for a GPT-like stack: embedding, `num_blocks` blocks, final norm + head."""
    n_stages = pp * virtual_stages
    names = ["embedding"] + [layer_name.format(i=i) for i in range(num_blocks)] + ["lm_head"]
    kinds = ["embedding"] + ["transformer_block"] * num_blocks + ["head"]
    per_stage = [len(names) // n_stages + (1 if s < len(names) % n_stages else 0) for s in range(n_stages)]
    stages, at = [], 0
    fwd_block = 0.012  # seconds per block per micro-batch (fixture value)
    for s in range(n_stages):
        layers = []
        for j in range(per_stage[s]):
            i = at + j
            layers.append(LayerChoice(
                name=names[i], kind=kinds[i],
                module_paths=[module_name or names[i]] if kinds[i] != "embedding" else ["wte", "wpe"],
                zero=1, checkpoint="selective" if kinds[i] == "transformer_block" else "none",
                tp_style="colwise_rowwise" if kinds[i] == "transformer_block" else "vocab"))
        at += per_stage[s]
        fwd = fwd_block * len(layers)
        stages.append(Stage(index=s, pp_rank=s % pp, layers=layers, predicted={
            "fwd_s": fwd, "bwd_s": 2 * fwd, "recompute_s": 0.1 * fwd, "tp_comm_s": 0.15 * fwd,
            "p2p_s": 0.0008 if pp > 1 else 0.0, "memory_bytes": 40 * GiB + s * GiB,
            "activation_bytes_per_micro_batch": 0.6 * GiB}))
    m, v = num_micro_batches, virtual_stages
    busy = m * max(sum(st.predicted["fwd_s"] * 3.1 for st in stages if st.pp_rank == r) for r in range(pp))
    bubble = (pp - 1) / (v * m) * busy
    tb = {"compute_s": busy * 0.8, "recompute_s": busy * 0.03, "tp_comm_s": busy * 0.12, "pp_comm_s": busy * 0.05,
          "dp_comm_s": 3.0, "dp_comm_exposed_s": 0.4, "bubble_s": bubble, "optimizer_s": 0.1}
    step = sum(v_ for k, v_ in tb.items() if k != "dp_comm_s")
    gbs = dp * micro_batch_size * m
    world = pp * dp * tp
    tflops = 140.0
    breakdown = []
    for r in range(pp):
        b = {"params": 20.5 * GiB, "grads": 20.5 * GiB, "optimizer": 15.4 * GiB,
             "activations": (pp - r) * 0.6 * GiB, "buffers": 3.0 * GiB, "capacity": capacity}
        breakdown.append(b)
    predicted = Predicted(
        step_time_s=step, tokens_per_s=gbs * (seq_len or 1) / step, tflops_per_gpu=tflops, mfu=tflops / 312.0,
        peak_memory_bytes=[sum(v_ for k, v_ in b.items() if k != "capacity") for b in breakdown],
        memory_breakdown=breakdown, time_breakdown=tb,
        comm=[
            {"axis": "tp", "collective": "all-reduce", "bytes": 48 * GiB, "time_s": tb["tp_comm_s"], "exposed_s": tb["tp_comm_s"], "tier": "intra_node"},
            {"axis": "dp", "collective": "reduce-scatter", "bytes": 21 * GiB, "time_s": 1.5, "exposed_s": 0.2, "tier": "inter_node"},
            {"axis": "dp", "collective": "all-gather", "bytes": 21 * GiB, "time_s": 1.5, "exposed_s": 0.2, "tier": "inter_node"},
            {"axis": "pp", "collective": "send/recv", "bytes": 9 * GiB, "time_s": tb["pp_comm_s"], "exposed_s": tb["pp_comm_s"], "tier": "inter_node"},
        ])
    alternatives = []
    if with_alternatives:
        alternatives = [
            {"mesh": {"pp": pp, "dp": dp, "tp": tp}, "schedule": "interleaved", "virtual_stages": 2,
             "micro_batch_size": micro_batch_size, "num_micro_batches": m, "sequence_parallel": True, "zero": 1,
             "checkpoint": "selective", "predicted": {"step_time_s": step * 1.04, "tokens_per_s": gbs * (seq_len or 1) / (step * 1.04), "mfu": 0.43},
             "status": "slower", "why": "twice the p2p traffic over InfiniBand outweighs the smaller bubble"},
            {"mesh": {"pp": max(1, pp // 2), "dp": dp * 2, "tp": tp}, "schedule": schedule, "virtual_stages": 1,
             "micro_batch_size": micro_batch_size, "num_micro_batches": max(1, m // 2), "sequence_parallel": True, "zero": 1,
             "checkpoint": "selective", "predicted": {"peak_memory_bytes": [91 * GiB]},
             "status": "oom", "why": "pp rank 0 needs 91.0 GiB, 15.0 GiB over the 76.0 GiB usable"},
        ]
    return Plan(
        model={"name": name, "source": f"examples/gpt.py:{name}", "total_params": total_params,
               "num_layers": len(names), "seq_len": seq_len},
        cluster={"nodes": nodes, "gpus_per_node": gpus_per_node, "device": device,
                 "intra_node_link": "nvlink3", "inter_node_link": "ib-hdr-200"},
        global_batch_size=gbs, seq_len=seq_len, precision="bf16", mesh=Mesh(pp=pp, dp=dp, tp=tp),
        sequence_parallel=True, schedule=schedule, virtual_stages=virtual_stages,
        micro_batch_size=micro_batch_size, num_micro_batches=m, stages=stages, predicted=predicted,
        alternatives=alternatives,
        solver={"status": "optimal", "time_s": 4.2, "candidates": 1830},
        assumptions={"peak_tflops": 312.0, "gemm_efficiency": 0.72, "collective_efficiency": {"intra_node": 0.8, "inter_node": 0.7},
                     "formulas": {"dp_time": "2 (n-1)/n x bytes / bandwidth"}},
    )


def make_small_plan(**kw) -> Plan:
    """8 GPUs on one node: pp 2, dp 2, tp 2, a 4-block model."""
    args = dict(name="gpt_tiny", total_params=70_000, nodes=1, gpus_per_node=8, pp=2, dp=2, tp=2, num_micro_batches=4, num_blocks=4, seq_len=16)
    args.update(kw)
    return make_plan(**args)


def test_fixture_round_trips_through_json():
    plan = make_plan()
    again = Plan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json()
    assert plan.mesh.world_size == 1024
    assert [s.pp_rank for s in plan.stages] == list(range(16))
    assert len(plan.layer_choices) == 98
