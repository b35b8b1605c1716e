"""The LoRA adapters this server serves by name: those of ``--lora-modules``, and where
run-time updating is allowed (vLLM's switch), those added and removed through
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``. The engine checks an
adapter when it is added and loads it into a slot when a request first names it. Each
name gets the next ``lora_int_id``; a name removed and added again gets a new one."""

from __future__ import annotations

from collections.abc import Sequence

from kvloom.lora.request import LoRARequest


class LoRAModules:
    def __init__(self, modules: Sequence[tuple[str, str]] = ()) -> None:
        self._requests: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in modules:
            self.add(name, path)

    def __contains__(self, name: object) -> bool:
        return name in self._requests

    def names(self) -> list[str]:
        return list(self._requests)

    def items(self) -> list[tuple[str, str]]:
        return [(name, lora.lora_path) for name, lora in self._requests.items()]

    def request(self, name: str | None) -> LoRARequest | None:
        """The adapter ``name`` names; None for any other name (the base model's)."""
        return self._requests.get(name) if name is not None else None

    def add(self, name: str, path: str) -> LoRARequest:
        """ValueError for a bad name or path (``LoRARequest``'s check) or a taken name."""
        if name in self._requests:
            raise ValueError(f"The LoRA adapter {name!r} has already been loaded.")
        lora = self._requests[name] = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return lora

    def remove(self, name: str) -> bool:
        return self._requests.pop(name, None) is not None
