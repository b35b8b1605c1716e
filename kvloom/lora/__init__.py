"""LoRA adapters served beside the base model (vLLM's ``--enable-lora``): each request
may name one adapter, and a batch mixes requests of several adapters and the base model."""

from kvloom.lora.request import LoRARequest

__all__ = ["LoRARequest"]
