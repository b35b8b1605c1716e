"""The eighteenth session's lora_cost.py (what serving through a rank-16 LoRA adapter
costs: 16 chat prompts x 64 tokens, base / adapter / half, three alternating rounds),
importing the kvloom of the checkout it is run from, so that two revisions compare:
    (cd CHECKOUT && /work/main/.venv/bin/python /work/main/docs/results/issue17/genoa19/lora_cost.py)"""

import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the checkout run from (a worktree of another revision too)
runpy.run_path(str(Path(__file__).resolve().parents[1] / "genoa18" / "lora_cost.py"), run_name="__main__")
