"""The ModelGraph: op graph (networkx), JSON form, symbolic evaluation."""
import json

import networkx as nx
import pytest
import torch

import autopar
import gpt
from autopar.capture import Layer, ModelGraph
from cost_models.workload import LayerSpec, ModelSpec, evaluate, fast


@pytest.fixture(scope="module")
def graph():
    model, inputs = gpt.gpt_tiny()
    return autopar.capture(model, inputs, name="gpt_tiny")


def test_public_types(graph):
    assert isinstance(graph, ModelGraph) and isinstance(graph, ModelSpec)
    assert Layer is LayerSpec and all(isinstance(layer, Layer) for layer in graph.layers)
    assert graph.name == "gpt_tiny" and graph.seq_len == 16 and graph.tokens_per_sample == 16
    assert graph.dtype == "bfloat16" and graph.dtype_bytes == 2


def test_op_graph_covers_every_layer_with_node_facts(graph):
    g = graph.graph
    assert isinstance(g, nx.DiGraph) and nx.is_directed_acyclic_graph(g)
    layers_in_graph = {data["layer"] for _, data in g.nodes(data=True) if data["layer"]}
    assert layers_in_graph == {layer.name for layer in graph.layers}
    for _, data in g.nodes(data=True):
        assert {"op", "kind", "module", "in_shapes", "in_dtypes", "out_shapes", "out_dtypes", "flops",
                "bytes_read", "bytes_written", "bytes"} <= set(data)
        assert data["bytes"] == data["bytes_read"] + data["bytes_written"]
    qkv = next(d for _, d in g.nodes(data=True) if d["module"] == "blocks.2.attn.qkv" and d["op"] == "aten.addmm")
    assert qkv["in_dtypes"] == ("bfloat16",) * 3 and qkv["flops"] > 0
    # Copied blocks carry their own module paths.
    modules = {data["module"] for _, data in g.nodes(data=True)}
    assert {"blocks.0.attn.qkv", "blocks.3.attn.qkv", "lm_head", "wte"} <= modules
    # Forward FLOPs in the graph (at the traced batch) equal the layers' forward FLOPs.
    total = sum(data["flops"] for _, data in g.nodes(data=True))
    assert total == sum(evaluate(layer.fwd_flops, graph.batch_size, graph.seq_len) for layer in graph.layers)
    # The graph is connected from the input to the logits.
    last = max((n for n, d in g.nodes(data=True) if d["module"] == "lm_head"), key=lambda n: int(n.split("/")[1]))
    assert nx.has_path(g, "input", last)


def test_to_dict_uses_public_names_and_evaluates_per_sample(graph):
    data = json.loads(graph.to_json())
    assert data["total_params"] == graph.total_params and data["batch_size"] == 1
    row = data["layers"][1]
    for key in ("name", "kind", "params", "param_bytes", "fwd_flops", "bwd_flops", "activation_bytes",
                "output_bytes", "input_bytes", "activation_bytes_tp_sharded", "activation_bytes_selective",
                "selective_recompute_flops", "tp_allreduces", "tp_degrees", "attrs", "signature", "module_paths",
                "shared_params", "expressions", "ops"):
        assert key in row
    layer = graph.layers[1]
    assert row["fwd_flops"] == evaluate(layer.fwd_flops, 1, 16)
    assert data["totals"]["fwd_flops"] == sum(r["fwd_flops"] for r in data["layers"])
    four = graph.to_dict(batch_size=4)
    assert four["layers"][1]["activation_bytes"] == 4 * row["activation_bytes"]
    assert fast(layer.fwd_flops)(4, 16) == evaluate(layer.fwd_flops, 4, 16)


def test_capture_is_deterministic():
    model, inputs = gpt.gpt_tiny()
    a, b = autopar.capture(model, inputs), autopar.capture(model, inputs)
    assert a.to_json() == b.to_json()


def test_backward_walk_trades_activations_for_gradients_in_autograd_order():
    """Each layer's walk through its backward ([alive activation share, gradient share]
    at its autograd nodes, the undominated ones). A Llama block runs its MLP's backward
    first: at w2's node every activation is still saved and w2's gradient (2048 of the
    block's 9280 parameters) is made; the MLP's gradients then coexist with the
    attention's activations (a + g > 1, the moment the FSDP peak of Llama 3 70B with full
    checkpointing sits in); at the end only the first norm's inputs remain."""
    import llama
    model, inputs = llama.llama_tiny()
    g = autopar.capture(model, inputs)
    walk = g.layers[1].attrs["bwd_walk"]
    assert g.layers[1].params == 9280
    assert walk[-1] == [1.0, round(2048 / 9280, 3)]
    assert walk[0][1] == 1.0 and 0.0 < walk[0][0] < 0.3
    # a frontier: more activations alive means fewer gradients made
    assert all(a1 < a2 and g1 > g2 for (a1, g1), (a2, g2) in zip(walk, walk[1:]))
    assert max(a + gr for a, gr in walk) > 1.1
