"""The engine's device and dtype from their configured names (``auto`` resolved)."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str) -> torch.dtype:
    # bf16 by default: AMX/oneDNN on CPU and tensor cores on GPU run it fastest.
    return {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]
