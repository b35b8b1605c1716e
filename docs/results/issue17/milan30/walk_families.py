"""OPT's and Cohere's layers in the native walk against the modules (the thirtieth session),
with the twenty-ninth session's harness (../milan29/walk_families.py: bf16 engine steps in one
process, the walk and the modules taking turns step by step; decode at batch 1 / 16 / 64 from
300 tokens of context, prefill steps of 4 x 256 tokens; median ms).

Random-weight models: OPT-125m's own shape (12 layers of 768, 12 heads of 64, a ReLU MLP of
3,072, 50,272 tokens, learned positions) and Command R7B's layer kinds at SmolLM2-135M's sizes
(30 layers of 576, 9 query and 3 KV heads of 64 dims, a SwiGLU of 1,536, 49,152 tokens; three
windowed layers of 512 keys to one full layer without rotary).

    .venv/bin/python docs/results/issue17/milan30/walk_families.py > docs/results/issue17/milan30/walk_families.txt
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("walk29", HERE.parent / "milan29" / "walk_families.py")
assert spec is not None and spec.loader is not None
walk29 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(walk29)

walk29.MODELS = {
    "opt-125m-shape": dict(arch="opt", hidden_size=768, ffn_dim=3072, num_hidden_layers=12, num_attention_heads=12,
                           vocab_size=50_272, max_position_embeddings=2048, tie_word_embeddings=True),
    "command-r7b-kinds-135m": dict(arch="cohere2", sliding_window=512, sliding_window_pattern=4, **walk29.SMOLLM2),
}

if __name__ == "__main__":
    walk29.main()
