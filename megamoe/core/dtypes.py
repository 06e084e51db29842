"""The floating dtypes megamoe names, one table: the configs' names (``model.params_dtype``,
``--dtype``) and the short names of the tools' lists (``--dtypes fp32,bf16``)."""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# the reference precisions a comparison runs in (``megamoe-precision --reference-dtype``)
REFERENCE = {"fp32": torch.float32, "fp64": torch.float64}
