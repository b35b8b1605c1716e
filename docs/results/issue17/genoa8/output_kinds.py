"""The host's work per decode step with every request CUMULATIVE (an output per step, each
token detokenized as it comes) against FINAL_ONLY (no output until the end, detokenized
once then), on the default model at context 300, greedy. The forward, the output head and
the argmax are replaced by stand-ins that return at once (zeros; fixed random logits), so
what is timed is the host's own work, warm; the two kinds alternate in one process, on
two engines holding the same requests.

    .venv/bin/python docs/results/issue17/genoa8/output_kinds.py 16,64,160 [ROUNDS]
"""
import gc
import random
import statistics
import sys
import time

import torch

from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.kernels import decoder_stack, gemm
from kvloom.models.default_model import resolve_default_model
from kvloom.sampling_params import RequestOutputKind, SamplingParams

STEPS = 20  # steps timed per round and kind


def main() -> None:
    batches = [int(b) for b in sys.argv[1].split(",")]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    logits: dict[tuple[int, int], torch.Tensor] = {}

    def head(x, packed, bias, n, isa):  # noqa: ANN001, ANN202 - gemm.gemm_bf16's signature
        if (x.shape[0], n) not in logits:
            logits[x.shape[0], n] = torch.randn(x.shape[0], n).bfloat16()
        return logits[x.shape[0], n]

    for batch in batches:
        engines = {}
        for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
            engine = LLMEngine(EngineConfig.from_kwargs(str(resolve_default_model()), dtype="bfloat16",
                                                        enable_prefix_caching=False, max_num_seqs=256,
                                                        num_blocks=batch * 40 + 64))
            rng = random.Random(0)
            params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, output_kind=kind)
            for _ in range(batch):
                engine.add_request([rng.randrange(10, 40000) for _ in range(300)], params)
            for _ in range(4):
                engine.step()
            engines[kind] = engine
        decoder_stack.run = lambda kernels, weights, shape, residual, *a, **k: torch.zeros_like(residual)
        gemm.gemm_bf16 = head
        times = {kind: [] for kind in engines}
        for _ in range(rounds):
            for kind, engine in engines.items():
                for _ in range(STEPS):
                    start = time.perf_counter()
                    engine.step()
                    times[kind].append(time.perf_counter() - start)
        print(f"batch {batch:3d}: " + ", ".join(f"{kind.name} {statistics.median(t) * 1e3:.3f} ms"
                                                 for kind, t in times.items()), flush=True)
        for engine in engines.values():
            engine.shutdown()
        del engines, engine
        gc.collect()


if __name__ == "__main__":
    main()
