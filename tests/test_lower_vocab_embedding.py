"""Embeddings split over the vocabulary keep their backward split
(tp_styles.VocabParallelEmbedding): the weight gradient autograd builds on a
tp rank is its own rows, not the whole vocab x hidden table that torch 2.13's
DTensor embedding backward builds before keeping the rank's rows (the
dp 2 x tp 4 row of benchmarks/results/memory_lowered.md, -13.5%). The values
are those of one process: every lowering equivalence test with tp runs it
(tests/test_lower_equivalence.py); here, 4 fake tp ranks, each rank's rows."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.lower import tensor_parallel, tp_styles
from autopar.lower.fake_mesh import fake_tp_mesh

V, H, TP = 64, 8, 4


class _Shapes(TorchDispatchMode):
    """Output shapes of every embedding backward the step runs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.embedding_dense_backward.default:
            self.seen.append(tuple(out.shape))
        return out


def _split_step(emb: nn.Embedding, ids: torch.Tensor, rank: int, mesh_of=None):
    """parallelize_vocab on one fake tp rank (`rank`: its coordinate), one forward +
    backward; -> (output, the weight's local gradient, embedding backward shapes)."""
    with fake_tp_mesh(TP) as mesh:
        mesh.get_local_rank = lambda *a, **k: rank  # this process plays tp rank `rank`
        holder = nn.Sequential(emb)
        tensor_parallel.parallelize_vocab(holder, mesh, position="pre")
        shapes = _Shapes()
        with shapes:
            out = holder(ids)
            out.sum().backward()
        return out, emb.weight.grad.to_local(), shapes.seen


@pytest.mark.parametrize("padding_idx", [None, 5, 37])
def test_each_tp_rank_builds_only_its_rows_gradient(padding_idx):
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 6))
    ids[0, :3] = 5
    ids[1, :2] = 37
    ref = nn.Embedding(V, H, padding_idx=padding_idx)
    want = ref(ids)
    want.sum().backward()
    rows = V // TP
    for rank in range(TP):
        emb = nn.Embedding(V, H, padding_idx=padding_idx)
        emb.load_state_dict(ref.state_dict())
        out, grad, shapes = _split_step(emb, ids, rank)
        assert shapes == [(rows, H)], "the backward built more than this rank's rows"
        assert torch.equal(grad, ref.weight.grad[rank * rows:(rank + 1) * rows])
        assert out.shape == want.shape  # (its values: the gloo equivalence tests; the fake group sums nothing)


def test_embeddings_it_cannot_run_alike_keep_torchs_style():
    assert tp_styles.local_lookup_runs(nn.Embedding(V, H), TP)
    for emb in (nn.Embedding(V, H, max_norm=1.0), nn.Embedding(V, H, scale_grad_by_freq=True),
                nn.Embedding(V, H, sparse=True), nn.Embedding(V + 2, H)):
        assert not tp_styles.local_lookup_runs(emb, TP)
    emb = nn.Embedding(V + 2, H)  # a vocabulary tp does not divide: DTensor's MaskPartial lookup
    _, _, shapes = _split_step(emb, torch.randint(0, V + 2, (2, 6)), 0)
    assert shapes and shapes[0][0] == V + 2  # torch 2.13 builds the whole table there
