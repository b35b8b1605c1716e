"""What attention sinks cost the CPU paged kernel: a bf16 decode step of BATCH sequences of
CONTEXT keys (GPT-OSS's heads: 8 query heads on 2 kv heads of 64 dims, the paired layout),
the kernel called with and without sinks, alternating; the median of CALLS calls each, over
ROUNDS rounds.

    .venv/bin/python docs/results/issue17/genoa32/attention_sinks_cost.py [BATCH] [CONTEXT] [ROUNDS]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests" / "attention"))

import torch  # noqa: E402
from test_attention_sinks import CPU, HEAD_DIM, HEADS, KV_HEADS, Scenario, scenario_case, sinks_for  # noqa: E402

from kvloom.attention.registry import make_backend  # noqa: E402

BATCH = int(sys.argv[1]) if len(sys.argv) > 1 else 16
CONTEXT = int(sys.argv[2]) if len(sys.argv) > 2 else 300
ROUNDS = int(sys.argv[3]) if len(sys.argv) > 3 else 5
CALLS = 200


def main() -> None:
    case = scenario_case(Scenario([(CONTEXT, 1)] * BATCH), torch.bfloat16)
    backend = make_backend("cpu_paged", CPU, HEADS, KV_HEADS, HEAD_DIM)
    cache = torch.zeros(2, case.num_blocks, case.block_size, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    backend.write_kv(cache, *case.history, torch.arange(case.num_blocks * case.block_size))
    assert backend.paired_layout(cache)
    metadata = backend.prepare(case.batch)
    sinks = sinks_for(torch.bfloat16)
    timings: dict[str, list[float]] = {"without": [], "with": []}
    for _ in range(ROUNDS):
        for name, given in (("without", None), ("with", sinks)):
            calls = []
            for _ in range(CALLS):
                start = time.perf_counter()
                backend.forward(case.q, case.k, case.v, cache, case.batch, metadata, 0, given)
                calls.append((time.perf_counter() - start) * 1e6)
            timings[name].append(statistics.median(calls))
    print(f"cpu_paged, bf16 paired, {BATCH} decodes of {CONTEXT} keys, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}; "
          f"median call (us) per round")
    for name, rounds in timings.items():
        print(f"  {name:8} sinks " + " / ".join(f"{us:.1f}" for us in rounds)
              + f"   median {statistics.median(rounds):.1f}")


if __name__ == "__main__":
    main()
