"""What GPT-OSS's extras cost a decode step: a random-weight GPT-OSS (biased q/k/v/o, attention
sinks, a window of 128 on every other layer, a biased router's top-k softmax, experts with
biases and the clamped SwiGLU) against a Mixtral of the same shapes (none of those), both bf16
on the module path, alternating in one process. Each: BATCH requests of CONTEXT random prompt
tokens, their prompts computed first, then STEPS decode steps timed (the median step of each
round).

    .venv/bin/python docs/results/issue17/genoa32/gpt_oss_steps.py [BATCH] [CONTEXT] [ROUNDS]
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))

from helpers_models import write_tiny_hf_model  # noqa: E402

from kvloom import SamplingParams  # noqa: E402
from kvloom.config import EngineConfig  # noqa: E402
from kvloom.engine.engine import LLMEngine  # noqa: E402

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 16
CONTEXT = int(sys.argv[2]) if len(sys.argv) > 2 else 300
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 3
STEPS = 24
# A small GPT-OSS-20b: its head and expert shapes, fewer and narrower layers.
SHAPE = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_hidden_layers=8,
             num_local_experts=16, num_experts_per_tok=4, intermediate_size=512, vocab_size=8192,
             max_position_embeddings=4096)


def median_step(path: Path) -> tuple[float, float]:
    """(the median step's ms, the experts a layer's step runs, on average)."""
    engine = LLMEngine(EngineConfig.from_kwargs(str(path), dtype="bfloat16", num_blocks=BATCH * (CONTEXT // 16 + 4),
                                                max_num_batched_tokens=BATCH * CONTEXT, enable_prefix_caching=False))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS + 2, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request([rng.randrange(10, 8000) for _ in range(CONTEXT)], params, request_id=str(i))
    engine.step()  # every prompt
    from kvloom.models.moe import SparseMoE

    layers = [m for m in engine.model.modules() if isinstance(m, SparseMoE)]
    hits: list[int] = []
    for layer in layers:  # count the experts each step's routing chooses
        layer.register_forward_hook(lambda module, args, out: hits.append(
            int(module.router(args[0])[1].unique().numel())))
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), sum(hits) / max(len(hits), 1)


def with_small_expert_biases(path: Path) -> Path:
    """The test models' expert biases (std 0.5, there to be seen) push every token's stream
    one way, so that all route to the same few experts and a step runs fewer of them than
    Mixtral's; at std 0.02 (the other weights' scale) both run about every expert a layer."""
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    for name in state:
        if name.endswith("_proj_bias"):
            state[name] = state[name] * 0.04
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return path


def main() -> None:
    root = Path(tempfile.mkdtemp())
    models = {
        "gpt_oss": with_small_expert_biases(write_tiny_hf_model(root / "gpt_oss", arch="gpt_oss", seed=1,
                                                                sliding_window=128, **SHAPE)),
        "mixtral": write_tiny_hf_model(root / "mixtral", arch="mixtral", seed=1, **SHAPE),
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for _ in range(ROUNDS):
        for name, path in models.items():
            results[name].append(median_step(path))
    print(f"batch {BATCH}, context {CONTEXT}, bf16, module path; median decode step per round (ms), "
          "experts run per layer and step")
    for name, rounds in results.items():
        steps = [ms for ms, _ in rounds]
        print(f"  {name:8} " + " / ".join(f"{ms:.2f}" for ms in steps) + f"   median {statistics.median(steps):.2f}"
              f"   experts {statistics.mean(hits for _, hits in rounds):.1f}")


if __name__ == "__main__":
    main()
