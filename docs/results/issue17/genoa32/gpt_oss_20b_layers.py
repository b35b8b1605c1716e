"""gpt-oss-20b's shapes on this CPU: a checkpoint with its config (hidden 2880, 64 query /
8 KV heads of 64, 32 experts of 2880 features, top 4, its 201,088-token vocabulary) but only
LAYERS of its 24 layers, random weights (experts as random MXFP4 codes, scales about 2 ** -6),
written in the hub's layout (quantization_config mxfp4). Decode steps of BATCH requests of
CONTEXT prompt tokens, bf16: the experts 4-bit (the MXFP4 kernel) and, with FOR_DENSE set,
read back to bf16 at load (--hf-overrides quantization_config null), alternating. Two layer
counts give a step's cost per layer and the rest (embedding, head, sampling), so 24 layers'.

    .venv/bin/python docs/results/issue17/genoa32/gpt_oss_20b_layers.py LAYERS BATCH [CONTEXT] [FOR_DENSE]
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))

from helpers_models import tiny_tokenizer_json  # noqa: E402

from kvloom import SamplingParams  # noqa: E402
from kvloom.config import EngineConfig  # noqa: E402
from kvloom.engine.engine import LLMEngine  # noqa: E402

LAYERS = int(sys.argv[1])
BATCH = int(sys.argv[2])
CONTEXT = int(sys.argv[3]) if len(sys.argv) > 3 else 300
FOR_DENSE = len(sys.argv) > 4 and sys.argv[4] == "dense"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, INTER, VOCAB = 2880, 64, 8, 64, 32, 2880, 201088
STEPS = 24


def write_checkpoint(path: Path) -> None:
    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * std).bfloat16()

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)

    state = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN), "lm_head.weight": normal(VOCAB, HIDDEN),
             "model.norm.weight": torch.ones(HIDDEN).bfloat16()}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        for name, rows, columns in (("q_proj", HEADS * HEAD_DIM, HIDDEN), ("k_proj", KV_HEADS * HEAD_DIM, HIDDEN),
                                    ("v_proj", KV_HEADS * HEAD_DIM, HIDDEN), ("o_proj", HIDDEN, HEADS * HEAD_DIM)):
            state[f"{prefix}self_attn.{name}.weight"] = normal(rows, columns)
            state[f"{prefix}self_attn.{name}.bias"] = normal(rows)
        state[f"{prefix}self_attn.sinks"] = normal(HEADS, std=1.0)
        state[f"{prefix}input_layernorm.weight"] = torch.ones(HIDDEN).bfloat16()
        state[f"{prefix}post_attention_layernorm.weight"] = torch.ones(HIDDEN).bfloat16()
        state[f"{prefix}mlp.router.weight"] = normal(EXPERTS, HIDDEN)
        state[f"{prefix}mlp.router.bias"] = normal(EXPERTS)
        for name, rows, inputs in (("gate_up_proj", 2 * INTER, HIDDEN), ("down_proj", HIDDEN, INTER)):
            state[f"{prefix}mlp.experts.{name}_blocks"] = codes(EXPERTS, rows, inputs // 32, 16)
            state[f"{prefix}mlp.experts.{name}_scales"] = torch.randint(119, 123, (EXPERTS, rows, inputs // 32),
                                                                        dtype=torch.uint8, generator=generator)
            state[f"{prefix}mlp.experts.{name}_bias"] = normal(EXPERTS, rows if name == "gate_up_proj" else HIDDEN)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": HIDDEN,
              "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_local_experts": EXPERTS,
              "num_experts_per_tok": 4, "vocab_size": VOCAB, "sliding_window": 128, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 131072, "rope_theta": 150000.0, "tie_word_embeddings": False,
              "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)],
              "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 4096},
              "quantization_config": {"quant_method": "mxfp4"}, "eos_token_id": 2, "bos_token_id": 0}
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer.json").write_text(tiny_tokenizer_json())


def median_step(path: Path, dense: bool) -> float:
    overrides = {"quantization_config": None} if dense else None
    engine = LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", max_model_len=4096,
                                                num_blocks=BATCH * (CONTEXT // 16 + 4),
                                                max_num_batched_tokens=max(BATCH * CONTEXT, 512),
                                                enable_prefix_caching=False, hf_overrides=overrides))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 2, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request([rng.randrange(10, 500) for _ in range(CONTEXT)], params, request_id=str(i))
    engine.step()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    path = Path(tempfile.mkdtemp())
    write_checkpoint(path)
    kinds = [False, True] if FOR_DENSE else [False]
    results: dict[bool, list[float]] = {kind: [] for kind in kinds}
    for _ in range(3):
        for dense in kinds:
            results[dense].append(median_step(path, dense))
    print(f"gpt-oss-20b shapes, {LAYERS} layers, batch {BATCH}, context {CONTEXT}, bf16: median decode step (ms)")
    for dense, steps in results.items():
        print(f"  experts {'bf16 (read back)' if dense else 'MXFP4 (4-bit)':18} " + " / ".join(f"{ms:.1f}" for ms in steps))


if __name__ == "__main__":
    main()
