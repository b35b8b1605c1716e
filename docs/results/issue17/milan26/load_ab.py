"""Time building the default model's engine (LLM(...), warm: files cached) with the code
at PYTHONPATH; run alternately from two checkouts:

    for i in 1 2 3 4 5; do (cd /tmp/old && PYTHONPATH=. python load_ab.py); PYTHONPATH=. python load_ab.py; done
"""

import time

from kvloom import LLM

LLM("smollm2-135m-instruct", num_blocks=256)  # the first: caches, kernels
start = time.perf_counter()
LLM("smollm2-135m-instruct", num_blocks=256)
print(f"load {time.perf_counter() - start:.3f} s")
