"""Model architectures (plain PyTorch), the architecture registry and checkpoint loading."""
