"""KV block bookkeeping in pure Python (no torch): pool, prefix caches, manager."""
