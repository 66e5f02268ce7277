"""The torch dtype each training precision computes in.

Plans, the CLI and profiles name precisions ("bf16", "fp16", "fp32"); capture,
calibration and lowering turn those names into dtypes here, in one table, so a
precision added later is added once."""
from __future__ import annotations

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# precisions that run under autocast (or FSDP2's mixed precision) over fp32 weights
LOW_PRECISION = ("bf16", "fp16")
