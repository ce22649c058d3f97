"""The dtype names configs and checkpoints use, and the torch dtypes they mean: the one table of them."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Config / HF config.json dtype name -> torch dtype."""
