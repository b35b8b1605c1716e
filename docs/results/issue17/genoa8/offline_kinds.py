"""The offline ShareGPT run (the engine settings of results/run_vs_openvino.sh) with every
request CUMULATIVE (an output per step, each token detokenized as it comes: the offline
bench before FINAL_ONLY) and FINAL_ONLY (what `kvloom bench offline` and LLM.generate now
ask for), alternating on one engine: seconds and output tokens per second of each run.
The prefix cache is off: the runs repeat the same prompts, which would hit it from the
second on (within one run these prompts share nothing, so it changes no run's work).

    .venv/bin/python docs/results/issue17/genoa8/offline_kinds.py WORKLOAD.jsonl NUM_PROMPTS [ROUNDS] [final-first]

(rounds alternate the order: A B, B A, A B, ...)
"""
import sys
import time
from pathlib import Path

from kvloom.bench import datasets
from kvloom.bench.offline import warm_up
from kvloom.config import EngineConfig
from kvloom.engine.engine import LLMEngine
from kvloom.sampling_params import RequestOutputKind, SamplingParams


def run(engine: LLMEngine, requests: list, kind: RequestOutputKind) -> tuple[float, int]:
    for item in requests:
        engine.add_request(item.prompt_token_ids, SamplingParams(max_tokens=item.expected_output_len, temperature=0.0,
                                                                 ignore_eos=True, output_kind=kind))
    tokens, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def main() -> None:
    path, num_prompts = sys.argv[1], int(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    model = str(Path.home() / "kvloom-peers/models/smollm2-135m-instruct")
    engine = LLMEngine(EngineConfig.from_kwargs(model, dtype="bfloat16", kv_cache_memory=4, max_num_seqs=256,
                                                enable_prefix_caching=False))
    requests = datasets.load_token_workload(path, num_prompts)
    warm_up(engine)
    kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
    if sys.argv[4:] == ["final-first"]:
        kinds.reverse()
    for round_ in range(rounds):
        for kind in kinds if round_ % 2 == 0 else kinds[::-1]:  # ABBA: neither kind always runs first
            seconds, tokens = run(engine, requests, kind)
            print(f"{kind.name:10s} {seconds:6.2f} s  {tokens / seconds:6.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
