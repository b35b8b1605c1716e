"""The engine's device and dtype from their configured names (``auto`` resolved), and
results copied from the device without waiting for it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when this torch has it, else the CPU. Raises ValueError for a CUDA
    device this torch cannot reach (a CPU build, or no GPU), before the model loads."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: this torch ({torch.__version__}) sees no CUDA device; "
                         "use --device cpu or auto")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 by default: AMX/oneDNN on CPU and tensor cores on GPU run it fastest. float16
    on a CPU becomes bf16, as vLLM's CPU backend does: its kernels (attention, the GEMM)
    take float32 and bf16 only."""
    if name == "float16" and device.type == "cpu":
        logger.warning("dtype float16 is not supported on CPU; using bfloat16 (or ask for float32)")
        return torch.bfloat16
    return {"auto": torch.bfloat16, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[name]


class HostCopy:
    """Device tensors on their way to the host, without waiting for the device: on CUDA
    each is copied into pinned memory behind the work queued so far and an event marks
    the end; ``wait`` blocks on that event alone, not on work queued after it (the next
    step's forward, with overlap scheduling). On the CPU the tensors are the host's."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            # A non-blocking device-to-host copy allocates pinned memory for its result.
            self._tensors = [tensor.to("cpu", non_blocking=True) for tensor in tensors]
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        else:
            self._tensors = list(tensors)

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            self._event.synchronize()
        return self._tensors


def host_values_to(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device`` without synchronising: on CUDA through
    pinned memory and an asynchronous copy (a copy from pageable memory waits for all
    the work queued on the device, which would stall overlap scheduling)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
