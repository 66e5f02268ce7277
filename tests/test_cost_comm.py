"""Collectives: nccl-tests ring formulas, hierarchical placement, DP/FSDP traffic."""
import pytest

from cost_models import comm as C
from cost_models.analytic import gpt
from cost_models.estimate import layer_cost
from cost_models.hardware import ClusterSpec
from cost_models.layout import Layout

GB = 1e9


def test_ring_formulas_are_nccl_tests():
    c = ClusterSpec.preset("dgx-a100")
    place = C.group_placement("tp", 8, 1, 1, c)
    bw, alpha = C.bus_bandwidth(place, c)
    assert place.tier == "intra_node" and bw == c.intra_link.bus_bandwidth
    S = 4 * GB
    n = 8
    assert C.collective_time("all_reduce", S, place, c) == pytest.approx(2 * (n - 1) / n * S / bw + 2 * (n - 1) * alpha)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert C.collective_time(kind, S, place, c) == pytest.approx((n - 1) / n * S / bw + (n - 1) * alpha)
    # bus bandwidth = algorithm bandwidth x 2(n-1)/n for all-reduce (nccl-tests PERFORMANCE.md)
    t = C.collective_time("all_reduce", S, place, c)
    assert (S / t) * 2 * (n - 1) / n == pytest.approx(bw, rel=2e-3)  # alpha: 42 us of 30 ms


def test_small_messages_take_the_tree():
    c = ClusterSpec.preset("dgx-h100", nodes=64)
    place = C.group_placement("dp", 8, 64, 1, c)
    n, (bw, alpha) = 64, C.bus_bandwidth(place, c)
    t = C.collective_time("all_reduce", 1024, place, c)
    assert t < 2 * (n - 1) * alpha  # beats the ring's latency
    # NCCL's tree, LL protocol (cost_models/nccl.py, tuning.cc): base 6.8 us + 2 x log2(64) network hops of 5 us
    assert t == pytest.approx((6.8 + 2 * 6 * 5.0) * 1e-6, rel=0.01)


def test_group_spanning_nodes_is_slower_by_the_link_ratio():
    c = ClusterSpec.preset("dgx-a100", nodes=8)
    inside = C.group_placement("dp", 1, 8, 1, c)  # 8 ranks in node 0
    across = C.group_placement("dp", 8, 8, 1, c)  # one rank per node
    assert (inside.tier, across.tier, across.ranks_per_node) == ("intra_node", "inter_node", 1)
    S = 1 * GB
    t_in = C.collective_time("all_reduce", S, inside, c)
    t_out = C.collective_time("all_reduce", S, across, c)
    ratio = c.intra_link.bus_bandwidth / c.inter_link.bus_bandwidth
    assert t_out / t_in == pytest.approx(ratio, rel=0.01)


def test_more_tp_inside_a_node_costs_less_than_across():
    model = gpt("g", hidden=8192, heads=64, layers=4, seq_len=2048, vocab_size=51200)
    layer = model.layers[1]
    small_nodes = ClusterSpec.preset("dgx-a100", nodes=4).with_nodes(4)
    small_nodes.gpus_per_node = 4  # 4-GPU nodes: tp=8 must cross the network
    big_nodes = ClusterSpec.preset("dgx-a100", nodes=2)
    layout = Layout(tp=8, micro_batch_size=1)
    inside = layer_cost(layer, model, layout, big_nodes)
    across = layer_cost(layer, model, layout, small_nodes)
    assert inside.tier["tp"] == "intra_node" and across.tier["tp"] == "inter_node"
    # 4 ranks per node drive 4 NIC rails: bus bandwidth min(NVLink, 4 x per-GPU IB)
    ratio = big_nodes.intra_link.bus_bandwidth / (4 * big_nodes.inter_link.bus_bandwidth)
    assert across.tp_comm_s / inside.tp_comm_s == pytest.approx(ratio, rel=0.1)


def test_zero3_traffic_is_1_5x_zero2():
    model = gpt("g", hidden=4096, heads=32, layers=4, seq_len=2048, vocab_size=51200)
    layer = model.layers[1]
    c = ClusterSpec.preset("dgx-h100", nodes=4)
    layout = Layout(dp=32, micro_batch_size=1, num_micro_batches=1)
    vol = {z: sum(b for _, b, _ in layer_cost(layer, model, layout, c, zero=z).dp_collectives) for z in (0, 1, 2, 3)}
    params = layer.params * 2 * 31 / 32
    assert vol[2] == pytest.approx(2 * params) and vol[1] == pytest.approx(vol[2]) and vol[0] == pytest.approx(vol[2])
    assert vol[3] / vol[2] == pytest.approx(1.5)


def test_fsdp_units_reduce_every_micro_batch_when_the_lowering_does():
    """Under gradient accumulation autopar's FSDP2 units reduce-scatter each micro-batch's
    gradients (ParallelModel._accumulate, as torchtitan; they stay sharded, as memory.py
    books them): Layout.grads_reduced_per_micro_batch prices m reduce-scatters, each under
    its own backward (and, FSDP2 resharding after each backward, m ZeRO-2 all-gathers), where Megatron's distributed optimizer (the field off) reduces once.
    candidate_layout sets it for autopar's program at dp > 1, pipelines included
    (pipeline_parallel.ReducingStage keeps sync on under torch's schedules)."""
    from autopar.engine import ENGINES
    from autopar.solve.layout import candidate_layout
    from autopar.solve.search_space import Candidate

    model = gpt("g", hidden=4096, heads=32, layers=4, seq_len=2048, vocab_size=51200)
    layer, c, m = model.layers[1], ClusterSpec.preset("dgx-h100", nodes=4), 4
    for zero in (2, 3):
        cost = {flag: layer_cost(layer, model, Layout(dp=32, micro_batch_size=1, num_micro_batches=m,
                                                      grads_reduced_per_micro_batch=flag), c, zero=zero)
                for flag in (False, True)}
        rs = {flag: sum(b for kind, b, _ in cost[flag].dp_collectives if kind == "reduce_scatter") for flag in cost}
        assert rs[True] == pytest.approx(m * rs[False]) and rs[False] > 0
        # and FSDP2 reshards after each backward: a ZeRO-2 unit gathers in every forward
        ag = {flag: sum(b for kind, b, _ in cost[flag].dp_collectives if kind == "all_gather") for flag in cost}
        assert ag[True] == pytest.approx(m * ag[False] if zero == 2 else ag[False]) and ag[False] > 0
        assert cost[True].dp_step_exposed_s <= cost[False].dp_step_exposed_s  # none left for the step's end
    # a pipeline stage keeps ZeRO-2 units gathered until its last backward: one gather a step
    piped = {flag: layer_cost(layer, model, Layout(dp=16, pp=2, micro_batch_size=1, num_micro_batches=m,
                                                   grads_reduced_per_micro_batch=flag), c, zero=2)
             for flag in (False, True)}
    ag = {flag: sum(b for kind, b, _ in piped[flag].dp_collectives if kind == "all_gather") for flag in piped}
    assert ag[True] == pytest.approx(ag[False]) and ag[False] > 0
    one = Layout(dp=32, micro_batch_size=1, num_micro_batches=1, grads_reduced_per_micro_batch=True)
    assert layer_cost(layer, model, one, c, zero=3).dp_collectives == \
        layer_cost(layer, model, Layout(dp=32, micro_batch_size=1, num_micro_batches=1), c, zero=3).dp_collectives
    cand = dict(micro_batch_size=1, num_micro_batches=m, schedule="accumulate")
    assert candidate_layout(Candidate(pp=1, dp=32, tp=1, **cand)).grads_reduced_per_micro_batch
    assert not candidate_layout(Candidate(pp=1, dp=1, tp=1, **cand)).grads_reduced_per_micro_batch
    assert candidate_layout(Candidate(pp=2, dp=16, tp=1, micro_batch_size=1, num_micro_batches=m,
                                      schedule="1f1b")).grads_reduced_per_micro_batch
    assert not candidate_layout(Candidate(pp=1, dp=32, tp=1, **cand),
                                engine=ENGINES["megatron"]).grads_reduced_per_micro_batch


def test_tp_traffic_is_megatrons_four_all_reduces_per_block():
    """Guards the mutation 'the all-reduce factor halved' in the bytes a tp group moves
    (issue 35 item 4h; the all-reduce's time is test_ring_formulas_are_nccl_tests'): a GPT
    block under tp t issues two all-reduces of the b x s x h activation forward and two
    backward (Megatron-LM, Shoeybi et al. 2019, Fig. 4; Korthikanti et al. 2022, section 4.2.2),
    and a ring all-reduce sends 2 (t-1)/t of its payload per GPU (nccl-tests' bus bandwidth,
    doc/PERFORMANCE.md): 4 x 2 (t-1)/t x 2 b s h bytes in bf16."""
    model = gpt("g", hidden=4096, heads=32, layers=4, seq_len=2048, vocab_size=51200)
    b, s, h, t = 2, 2048, 4096, 8
    lc = layer_cost(model.layers[1], model, Layout(tp=t, micro_batch_size=b), ClusterSpec.preset("dgx-h100"))
    assert dict(lc.tp_calls) == {"all_reduce": 4}
    assert lc.tp_comm_bytes == pytest.approx(4 * 2 * (t - 1) / t * 2 * b * s * h)


def test_overlap_hides_dp_but_never_tp():
    model = gpt("g", hidden=4096, heads=32, layers=4, seq_len=4096, vocab_size=51200)
    layer = model.layers[1]
    c = ClusterSpec.preset("dgx-h100")
    lc = layer_cost(layer, model, Layout(tp=2, dp=4, micro_batch_size=4, zero=3), c)
    # FSDP prefetch hides the transfers; what they still cost is the SMs NCCL holds meanwhile
    transfer_exposed = lc.dp_comm_exposed_s - lc.nccl_contention_s
    assert lc.dp_comm_s > 0 and transfer_exposed < 0.2 * lc.dp_comm_s
    assert C.TP_OVERLAP == 0.0 and lc.tp_comm_s > 0


def test_nccl_channels_follow_the_maintainers_figures():
    """NVIDIA/nccl#689: 16 SMs on a DGX with 8 NICs (~190 GB/s); #438: 2 channels per NIC."""
    a100 = ClusterSpec.preset("dgx-a100", nodes=4)
    whole_nodes = C.group_placement("dp", 1, 32, 1, a100)  # 8 ranks on each of 4 nodes: all 8 rails
    assert whole_nodes.tier == "inter_node"
    assert 14 <= C.nccl_sm_fraction(whole_nodes, a100) * 108 <= 16
    one_per_node = C.group_placement("dp", 8, 4, 1, a100)  # tp8 inside the node: one rail per group
    assert C.nccl_sm_fraction(one_per_node, a100) * 108 == pytest.approx(2)
    assert C.nccl_sm_fraction(C.group_placement("dp", 1, 1, 1, a100), a100) == 0.0  # no collective
    gloo = ClusterSpec.preset("cpu-gloo", nodes=1)  # gloo runs on host threads
    assert C.nccl_sm_fraction(C.group_placement("dp", 1, 2, 1, gloo), gloo) == 0.0


def test_hidden_collectives_slow_the_compute_they_hide_under():
    model = gpt("g", hidden=4096, heads=32, layers=4, seq_len=4096, vocab_size=51200)
    layer = model.layers[1]
    c = ClusterSpec.preset("dgx-h100")
    lc = layer_cost(layer, model, Layout(dp=8, micro_batch_size=2, zero=3), c)
    place = C.group_placement("dp", 1, 8, 1, c)
    f = C.nccl_sm_fraction(place, c)
    assert 0.2 < f < 0.3  # NVLink4 busbw ~368 GB/s -> 31 of 132 SMs
    # the forward and backward gathers and the reduce-scatter all hide, so each costs f x its time
    gathers, rs = (t for _, _, t in lc.dp_collectives)
    # ... plus FSDP2's copy-out of each gathered unit (forward and backward), on the compute stream
    device = c.device_profile
    copy_out = 2 * lc.params_local * 2 / (device.memory_bandwidth * device.memory_efficiency)
    assert lc.dp_comm_exposed_s == pytest.approx(lc.nccl_contention_s + 2 * copy_out)
    assert lc.nccl_contention_s == pytest.approx(f * (gathers + rs))


def test_intra_node_all_reduce_follows_a_measured_h200_sweep():
    """8 x H200 torch all_reduce by payload (benchmarks/reference/all_reduce_8xh200_sweep.csv,
    stas00/ml-engineering). Up to 64 MiB the ring model (14 steps of the NVLink 4 latency plus
    the bytes at ring bus bandwidth) is within 17%: small payloads are latency-bound, as a ring
    inside a node is (a tree's 6 steps would be 2x too fast). Above, NCCL switches to NVLS
    (reduction in the NVSwitch) and beats the ring by up to 31%: priced as a ring, stated here."""
    import csv

    from conftest import ROOT

    rows = [r for r in csv.DictReader(line for line in open(ROOT / "benchmarks" / "reference" / "all_reduce_8xh200_sweep.csv")
                                      if not line.startswith("#"))]
    c = ClusterSpec.preset("dgx-h200")
    place = C.group_placement("dp", 1, 8, 1, c)
    for r in rows:
        size = int(r["payload_bytes"])
        measured = size / (float(r["algbw_gbs"]) * 1e9)
        predicted = C.collective_time("all_reduce", size, place, c)
        if size <= 64 * 2**20:
            assert predicted == pytest.approx(measured, rel=0.17), size
        else:
            assert measured * 0.99 <= predicted <= measured * 1.32, size
