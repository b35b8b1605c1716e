"""A random-weight model of SmolLM2-135M's shape that two ranks can split: 30 layers,
hidden 576, MLP 1536, vocabulary 49152, tied head, but 8 query and 4 KV heads of 64
(the real model's 9 and 3 divide by 3, not by 2). Its tokenizer is the default model's.
Usage: python make_tp_model.py OUT_DIR"""

import shutil
import sys
from pathlib import Path

import torch
import transformers

from kvloom.paths import kvloom_home

out = Path(sys.argv[1])
config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                                  vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
                                  rms_norm_eps=1e-5, rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
model.save_pretrained(out)
# The default model's GGUF, converted once by kvloom (run `kvloom fetch-model` and one
# `kvloom generate` first), holds its tokenizer as tokenizer.json.
converted = next((kvloom_home() / "gguf-cache").glob("SmolLM2-135M-Instruct*"))
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(converted / name, out / name)
print(out)
