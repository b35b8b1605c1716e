"""LoRARequest: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """``lora_name`` names the adapter (the server's ``model`` field; the prefix cache
    keeps each adapter's KV apart by it); ``lora_path`` is a PEFT adapter directory
    (``adapter_config.json`` and ``adapter_model.safetensors``); ``lora_int_id`` is
    vLLM's positive id, checked and kept for compatibility. One name, one path: a name
    the engine has loaded from another path is refused."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name or "\0" in self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string without NUL, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
