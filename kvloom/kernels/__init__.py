"""Native kernels registered as PyTorch ops (``torch.ops.kvloom.*``), each with a schema
and a pure-PyTorch reference."""
