"""Past one process: the tensor-parallel group (``group.py``) and how its ranks start
(``launch.py``: spawned on this host, or by torchrun across hosts)."""
