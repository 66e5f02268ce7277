"""Hardware profiles: shipped presets load, names resolve, bad files name field and file."""
import json

import pytest

from cost_models.errors import CostModelError, ProfileError
from cost_models.hardware import ClusterSpec, get_device, get_link, shipped_clusters, shipped_devices, shipped_links

DEVICES = ("a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h200", "b200", "v100-32g", "mi300x", "cpu")
LINKS = ("nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "ib-hdr", "ib-ndr", "ethernet", "roce-400")


def test_shipped_profiles_cover_the_issue_list():
    assert set(DEVICES) <= set(shipped_devices())
    assert set(LINKS) <= set(shipped_links())
    assert {"dgx-a100", "dgx-h100"} <= set(shipped_clusters())


def test_datasheet_figures():
    assert get_device("h100-sxm").peak("bf16") == pytest.approx(989e12)
    assert get_device("a100-80g").peak("bf16") == pytest.approx(312e12)
    assert get_device("h100-sxm").memory_bandwidth == pytest.approx(3.35e12)
    # NVLink3 bus bandwidth reproduces the measured 234.89 GB/s of interconnect.csv within 1%
    assert get_link("nvlink3").bus_bandwidth == pytest.approx(234.89e9, rel=0.01)
    assert get_link("nvlink4").bus_bandwidth == pytest.approx(367.61e9, rel=0.01)
    with pytest.raises(CostModelError, match="no bf16 peak"):
        get_device("v100-32g").peak("bf16")


def test_cluster_resolve_forms(tmp_path):
    c = ClusterSpec.resolve("dgx-h100:4")
    assert (c.nodes, c.world_size, c.device) == (4, 32, "h100-sxm")
    assert ClusterSpec.resolve("a100-80g").intra_node_link == "nvlink3"
    assert ClusterSpec.resolve(c) is c
    path = tmp_path / "c.json"
    path.write_text(json.dumps(c.to_dict()))
    again = ClusterSpec.resolve(str(path))
    assert again.to_dict() == {**c.to_dict()}
    assert ClusterSpec.from_dict(c.to_dict()).world_size == 32


def test_user_file_with_own_device(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(
        "cluster: {nodes: 2, gpus_per_node: 4, device: my-gpu, intra_node_link: my-link, inter_node_link: ib-ndr}\n"
        "devices:\n  my-gpu: {peak_tflops: {bf16: 500}, memory_gib: 96, memory_bandwidth_tbs: 4}\n"
        "links:\n  my-link: {bandwidth_gbs: 200, latency_us: 2}\n")
    c = ClusterSpec.from_file(path)
    assert c.world_size == 8
    assert c.device_profile.peak("bf16") == 500e12
    assert c.intra_link.bandwidth == 200e9


@pytest.mark.parametrize("body, field", [
    ("cluster: {device: h900}\n", "device"),
    ("cluster: {device: h100-sxm, intra_node_link: nvlink9}\n", "intra_node_link"),
    ("cluster: {device: h100-sxm, nodes: -1}\n", "nodes"),
    ("cluster: {device: h100-sxm, inter_node_link: bad}\nlinks:\n  bad: {bandwidth_gbs: -5, latency_us: 1}\n",
     "links.bad.bandwidth_gbs"),
    ("cluster: {device: x}\ndevices:\n  x: {memory_gib: 80, memory_bandwidth_tbs: 2}\n", "devices.x.peak_tflops"),
    ("cluster: {device: x}\ndevices:\n  x: {peak_tflops: {bf16: 100}, memory_bandwidth_tbs: 2}\n",
     "devices.x.memory_gib"),
    ("cluster: {device: x}\ndevices:\n  x: {peak_tflops: {bf16: 100}, memory_gib: 8, memory_bandwidth_tbs: 2,"
     " gemm_max_efficiency: 1.5}\n", "devices.x.gemm_max_efficiency"),
    ("cluster: {device: x}\ndevices:\n  x: {peak_tflops: {bf16: 100}, memory_gib: 8, memory_bandwidth_tbs: 2,"
     " clock_spread: -0.01}\n", "devices.x.clock_spread"),
    ("cluster: {device: h100-sxm, gpus: 8}\n", "gpus"),
])
def test_bad_profiles_name_field_and_file(tmp_path, body, field):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ProfileError) as info:
        ClusterSpec.from_file(path)
    msg = str(info.value)
    assert f"'{field}'" in msg and str(path) in msg
    assert isinstance(info.value, ValueError)


def test_unreadable_and_unknown_inputs(tmp_path):
    with pytest.raises(ProfileError, match="not valid YAML"):
        p = tmp_path / "x.yaml"
        p.write_text("cluster: [unclosed\n")
        ClusterSpec.from_file(p)
    with pytest.raises(ProfileError, match="not a cluster preset"):
        ClusterSpec.resolve("no-such-thing")
    with pytest.raises(ProfileError, match="unknown cluster preset"):
        ClusterSpec.preset("dgx-z100")


def test_cost_models_never_imports_autopar():
    import subprocess
    import sys
    code = ("import sys, cost_models, cost_models.estimate, cost_models.analytic, cost_models.pipeline;"
            "print(any(m == 'autopar' or m.startswith('autopar.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_costs_follow_the_profile_not_a_stale_cache(tmp_path):
    from cost_models.analytic import gpt
    from cost_models.estimate import layer_cost
    from cost_models.layout import Layout
    model = gpt("g", hidden=2048, heads=16, layers=2, seq_len=1024, vocab_size=1000)
    def cluster(tflops):
        return ClusterSpec.from_dict({"cluster": {"device": "x", "intra_node_link": "nvlink4"},
                                      "devices": {"x": {"peak_tflops": {"bf16": tflops}, "memory_gib": 80,
                                                        "memory_bandwidth_tbs": 3}}})
    slow = layer_cost(model.layers[1], model, Layout(micro_batch_size=4), cluster(100))
    fast = layer_cost(model.layers[1], model, Layout(micro_batch_size=4), cluster(1000))
    assert slow.fwd_s > 3 * fast.fwd_s


def test_sustained_clocks_follow_their_stated_derivation():
    # docs/cost_model.md s.1 / profiles/devices.yaml: A100 holds 1305 of its 1410 MHz at 400 W (the
    # HPL Rpeak clock); Hopper's datasheet clock 1830 is below its 1980 MHz burst clock and is held in
    # the A100's proportion; B200's datasheet clock is not published, so the A100 ratio alone.
    assert get_device("h200").sustained_clock_fraction == pytest.approx(1830 / 1980 * 1305 / 1410, abs=1e-3)
    assert get_device("b200").sustained_clock_fraction == pytest.approx(1305 / 1410, abs=1e-3)
    assert get_device("h100-sxm").sustained_clock_fraction == get_device("h200").sustained_clock_fraction  # same die, 700 W
    # 500 W cap: the 700 W sustained clock scaled by the cube root of the power ratio
    assert get_device("h100-96g-500w").sustained_clock_fraction == pytest.approx(
        get_device("h100-sxm").sustained_clock_fraction * (500 / 700) ** (1 / 3), abs=1e-3)
    assert get_device("a100-80g").sustained_clock_fraction == pytest.approx(1305 / 1410, abs=1e-3)  # HPL Rpeak clock
    # the burst ceiling (MAMF) of an H100 does not depend on its power cap
    assert get_device("h100-96g-500w").gemm_max_efficiency == get_device("h100-sxm").gemm_max_efficiency
    # the spread of sustained speed across GPUs: Sinha et al. SC'22, 8% over a ~25,000-GPU cluster
    assert get_device("h200").clock_spread == pytest.approx(0.08 / 2 / 4.07, abs=2e-4)
    assert get_device("cpu").clock_spread == 0.0


def test_with_nodes_rescales_the_cluster():
    from cost_models.hardware import ClusterSpec

    cluster = ClusterSpec.resolve("dgx-a100:4")
    bigger = cluster.with_nodes(16)
    assert (bigger.nodes, bigger.world_size) == (16, 16 * cluster.gpus_per_node)
    assert bigger.device == cluster.device and bigger.inter_node_link == cluster.inter_node_link
