"""The scheduler's seam to the LoRA adapters' slots (kvloom/lora/manager.py): a request
on an adapter holds a slot from its admission until it finishes or is preempted, so that
a step's requests never need more adapters than the model has slots. The null one
(LoRA off) holds nothing."""

from __future__ import annotations

from typing import Protocol

from kvloom.request import Request


class AdapterSlots(Protocol):
    def hold(self, request: Request) -> bool:
        """Hold the slot of ``request``'s adapter (``request.lora_key``), loading it if
        need be: False if every slot holds an adapter of other running requests.
        ValueError if the adapter can no longer be served (unloaded while it waited)."""
        ...

    def free(self, request: Request) -> None:
        """Let go of the request's slot, if it holds one."""
        ...


class NoAdapterSlots:
    """LoRA off: no request names an adapter (the engine refuses them), none holds a slot."""

    def hold(self, request: Request) -> bool:
        return True

    def free(self, request: Request) -> None:
        pass
