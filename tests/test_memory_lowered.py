"""The memory of the program autopar's own lowering builds against the plan (issue 35, item 3)."""
from __future__ import annotations

import pytest
from conftest import benchmark_rows


@pytest.mark.slow
def test_lowered_program_memory_agrees_with_the_plan(tmp_path):
    """benchmarks/memory_lowered.py --cases: autopar's `lower` (not a copy) on rank 0 of a
    fake process group of 8 under FakeTensorMode, two ParallelModel.train_steps, the second
    under FSDPMemTracker: Llama 3 8B width with ZeRO-3 (reshard after forward) and ZeRO-2
    (not), Llama 3 70B width with full recomputation (its peak is a block's backward: the
    recomputed activations beside the block's gradients). Each within 5% of the plan's
    peak, and FSDP2's persistent states (fp32 parameter shards + AdamW moments) exactly the
    12 B/param/dp the plan books. Flipping reshard_after_forward in
    autopar/lower/data_parallel.py moves the ZeRO-3 rank by -23% and the ZeRO-2 rank by
    +32%; dropping the recomputation working memory from the cost model
    (LayerCost.working_bytes) moves the 70B rank from -2.6% to -5.9%
    (benchmarks/results/memory_lowered.md). Two micro-batches a step: FSDP2 reduce-scatters
    each micro-batch's gradients, as priced (with gradient sync off until the last one it
    held every unit's unsharded gradient: -25.6%). The committed table has every layout."""
    out = tmp_path / "ml"
    cases = ["llama3_8b_l4_s2048_dp8_z3_none", "llama3_8b_l4_s2048_dp8_z2_none", "llama3_70b_l2_s4096_dp8_z3_full",
             "llama3_8b_l4_s2048_dp8_z3_none_2mb"]
    rows = benchmark_rows("memory_lowered.py", cases, out, timeout=900)
    assert [r["case"] for r in rows] == cases  # one rank each (dp only)
    for row in rows:
        assert "error" in row, row.get("failure")
        assert row["wrapper"] == "FSDP2"
        assert row["tracked_bytes"] > 3.5 * 2 ** 30  # a real-size rank, not a toy
        assert abs(row["error"]) < 0.05, (row["case"], row["error"])
        t = row["tracked"]
        assert t["SHARDED_PARAM"] + t["OPT"] == pytest.approx(12 * row["total_params"] / 8, rel=0.01), row["case"]


@pytest.mark.slow
def test_pipeline_stages_reduce_every_micro_batch_as_priced(tmp_path):
    """pp 2 x dp 4, ZeRO-2, 1F1B over 4 micro-batches, both pp ranks: torch's pipeline stage
    turns FSDP2's gradient sync and reshard-after-backward off until the last micro-batch,
    holding every unit's unsharded gradient (-18.3% / -22.0% against the plan);
    pipeline_parallel.ReducingStage keeps them on, and the estimate books each backward's
    reduce-scatter moments (the last stage peaks at its head's, beside the logits the stage
    keeps), ZeRO-2 units kept gathered until the last micro-batch (one all-gather a step):
    -5.3% / +4.6% (rank 0 peaks at the embedding's backward, whose 0.78 GiB of temporaries
    the estimate does not book: held to 6%). With torch's PipelineStage back in the lowering
    both ranks hold unsharded gradients: this fails."""
    case = "llama3_8b_l4_s2048_dp4_pp2_z2_none"
    rows = benchmark_rows("memory_lowered.py", [case], tmp_path / "ml", timeout=600)
    assert all("error" in r for r in rows), [r.get("failure") for r in rows]
    assert [(r["case"], r["pp_rank"]) for r in rows] == [(case, 0), (case, 1)]
    for row in rows:
        assert row["wrapper"] == "FSDP2"
        # reduced every micro-batch: at most the unit being reduced (a 128k-vocabulary embedding
        # or head, 0.98 GiB); torch's stage held every unit's (2.20 / 1.39 GiB)
        assert row["tracked"]["UNSHARDED_GRAD"] < 1.1 * 2 ** 30, row["tracked"]
        assert abs(row["error"]) < 0.06, (row["pp_rank"], row["error"])
